"""Runs side by side: result folders of one model (two formats, two policies, before and after
training) aligned by site name, with what changed beyond a threshold.

The first run is the baseline; every later run gets its per-site deltas against it (later minus
first), the sites that got worse or better by more than `threshold_db`, and the flags that
appeared or disappeared. Three result kinds compare, each only with its own kind:

- scan reports (`report.json`): rows aligned by (site, point); SQNR, rel_rmse, deadzone,
  saturation; a site is worse when its SQNR drops by more than the threshold;
- sensitivity reports (`sensitivity.json`): sites aligned by name; the end-to-end score (exact,
  else the estimate) as a ratio in dB (10·log10 later/first), and the rank; a site is worse when
  it became more sensitive by more than the threshold;
- parity reports (`parity.json`): verl's metrics side by side, and the attribution's sites
  (k3_kl each adds alone) as a ratio in dB. Read as their JSON data: `qtransform.rl` is a sibling
  package that `scan` never imports.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.core.result import decode_numbers, json_file
from qtransform.errors import UserError
from qtransform.scan.render import format_metric
from qtransform.scan.report import ScanReport
from qtransform.scan.sensitivity_report import SensitivityReport

SCHEMA = "qtransform.run_comparison"
SCHEMA_VERSION = "1"
FILES = ("comparison.json", "comparison.md")
RESULT_FILES = {"report.json": "scan", "sensitivity.json": "sensitivity", "parity.json": "parity"}
SCAN_METRICS = ("sqnr_db", "rel_rmse", "deadzone", "saturation")
DEFAULT_THRESHOLD_DB = 1.0
_SHOWN = 5  # site names quoted in an error message
LISTED = 20  # sites named per change in the Markdown summary


@dataclass
class Run:
    """One result folder: its kind, where it was read, a short label and its data."""

    kind: str  # scan | sensitivity | parity
    path: Path
    label: str
    meta: dict[str, Any]
    sites: dict[str, dict[str, Any]]  # aligned key -> values (metrics, flags, shape)
    summary: dict[str, float] = field(default_factory=dict)  # parity: verl's metrics


@dataclass
class RunComparison:
    """Runs of one kind aligned by site: values per run, deltas against the first, changes."""

    kind: str
    runs: list[Run]
    threshold_db: float
    keys: list[str]  # sites every run has, in the first run's order
    only: dict[str, list[str]]  # run label -> sites no other run has

    @property
    def metrics(self) -> tuple[str, ...]:
        return SCAN_METRICS if self.kind == "scan" else ("score_db", "rank")

    def delta(self, key: str, metric: str, run: int) -> float:
        """Later minus first (scores of sensitivity and parity: their ratio in dB)."""
        a, b = self.runs[0].sites[key][metric], self.runs[run].sites[key][metric]
        return b - a

    def change(self, key: str, run: int) -> str:
        """worse | better | "" for run `run` against the first, by the threshold in dB."""
        d = self.delta(key, "sqnr_db" if self.kind == "scan" else "score_db", run)
        if math.isnan(d):
            return ""
        worse = d < -self.threshold_db if self.kind == "scan" else d > self.threshold_db
        better = d > self.threshold_db if self.kind == "scan" else d < -self.threshold_db
        return "worse" if worse else "better" if better else ""

    def flags(self, key: str, run: int) -> tuple[list[str], list[str]]:
        """(appeared, disappeared): flags of run `run` the first has not, and the reverse."""
        a = self.runs[0].sites[key].get("flags", [])
        b = self.runs[run].sites[key].get("flags", [])
        return [f for f in b if f not in a], [f for f in a if f not in b]

    def to_dict(self) -> dict[str, Any]:
        later = range(1, len(self.runs))
        sites = []
        for key in self.keys:
            entry: dict[str, Any] = {"site": key, "values": [r.sites[key] for r in self.runs],
                                     "deltas": [], "changes": []}
            for i in later:
                entry["deltas"].append({m: self.delta(key, m, i) for m in self.metrics})
                appeared, gone = self.flags(key, i)
                entry["changes"].append({"change": self.change(key, i), "flags_appeared": appeared,
                                         "flags_disappeared": gone})
            sites.append(entry)
        return encode_floats({
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": self.kind,
            "threshold_db": self.threshold_db,
            "runs": [{"label": r.label, "path": str(r.path), "meta": r.meta, "summary": r.summary}
                     for r in self.runs],
            "sites": sites, "only": self.only,
        })

    def markdown(self) -> str:
        first = self.runs[0].label
        lines = [f"# {self.kind.capitalize()} runs side by side", ""]
        lines += [f"- {r.label}: `{r.path}` ({_describe(r)})" for r in self.runs]
        lines += [f"- baseline: {first}; deltas are later minus {first}"
                  + ("" if self.kind == "scan" else " (scores as 10·log10 of their ratio, in dB)")
                  + f"; a change beyond {self.threshold_db:g} dB counts as worse or better", ""]
        if self.kind == "parity":
            lines += self._summary_table()
        for i in range(1, len(self.runs)):
            lines += self._changes(i)
        lines += ["", "## Sites", "", *self._site_table()]
        for label, keys in self.only.items():
            if keys:
                lines += ["", f"Only in {label} ({len(keys)}): " + ", ".join(keys)]
        return "\n".join(lines) + "\n"

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """comparison.json and comparison.md, each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return {"json": qio.write_json(out / FILES[0], self.to_dict()),
                "md": qio.write_text(out / FILES[1], self.markdown())}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunComparison:
        """Read comparison.json (or the folder `save` wrote): the runs as they were aligned."""
        p = json_file(path, FILES[0])
        text = qio.read_input_text(p, "run comparison (give comparison.json or its folder)")
        try:
            data = json.loads(text)
            if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"not a run comparison of version {SCHEMA_VERSION}")
            keys = [entry["site"] for entry in data["sites"]]
            runs = [Run(data["kind"], Path(r["path"]), r["label"], dict(r["meta"]),
                        {k: decode_numbers(e["values"][i]) for k, e in zip(keys, data["sites"], strict=True)},
                        decode_numbers(r["summary"]))
                    for i, r in enumerate(data["runs"])]
            return cls(data["kind"], runs, float(data["threshold_db"]), keys,
                       {label: list(sites) for label, sites in data["only"].items()})
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise UserError(f"{p}: not a run comparison this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                            "re-run `qtransform report`") from None

    # -- Markdown pieces ----------------------------------------------------------------------
    def _summary_table(self) -> list[str]:
        names = [k for k in self.runs[0].summary if all(k in r.summary for r in self.runs)]
        head = ["metric", *(r.label for r in self.runs),
                *(f"Δ {r.label}" for r in self.runs[1:])]
        body = [[k, *(f"{r.summary[k]:.4g}" for r in self.runs),
                 *(f"{r.summary[k] - self.runs[0].summary[k]:+.3g}" for r in self.runs[1:])]
                for k in names]
        return ["## Mismatch metrics", "", *_table(head, body), ""]

    def _changes(self, run: int) -> list[str]:
        label, first = self.runs[run].label, self.runs[0].label
        worse = [k for k in self.keys if self.change(k, run) == "worse"]
        better = [k for k in self.keys if self.change(k, run) == "better"]
        measure = "SQNR" if self.kind == "scan" else "sensitivity"
        lines = [f"## {label} against {first}", "",
                 f"- worse ({measure}, beyond {self.threshold_db:g} dB): {len(worse)}{self._list(worse, run)}",
                 f"- better: {len(better)}{self._list(better, run)}"]
        if self.kind == "scan":
            appeared = [(k, self.flags(k, run)[0]) for k in self.keys if self.flags(k, run)[0]]
            gone = [(k, self.flags(k, run)[1]) for k in self.keys if self.flags(k, run)[1]]
            lines.append(f"- flags that appear: {len(appeared)}")
            lines += [f"  - {k}: {'; '.join(f)}" for k, f in appeared]
            lines.append(f"- flags that disappear: {len(gone)}")
            lines += [f"  - {k}: {'; '.join(f)}" for k, f in gone]
        return lines + [""]

    def _list(self, keys: list[str], run: int) -> str:
        """": a (+1.2 dB), b (...)", the largest moves first, at most LISTED (the table has all)."""
        metric = "sqnr_db" if self.kind == "scan" else "score_db"
        order = sorted(keys, key=lambda k: -abs(_finite(self.delta(k, metric, run))))
        more = f" and {len(keys) - LISTED} more (the table below lists every site)" if len(keys) > LISTED else ""
        return (": " + ", ".join(self._named(k, run) for k in order[:LISTED]) + more) if keys else ""

    def _named(self, key: str, run: int) -> str:
        metric = "sqnr_db" if self.kind == "scan" else "score_db"
        return f"{key} ({self.delta(key, metric, run):+.2f} dB)"

    def _site_table(self) -> list[str]:
        main = "sqnr_db" if self.kind == "scan" else "score_db"
        unit = "SQNR dB" if self.kind == "scan" else "score dB"
        head = ["site", *(f"{unit} {r.label}" for r in self.runs),
                *(f"Δ {r.label}" for r in self.runs[1:]), *(f"change {r.label}" for r in self.runs[1:])]
        if self.kind == "scan":
            head += [f"deadzone {r.label}" for r in self.runs]
        else:
            head += [f"rank {r.label}" for r in self.runs]
        body = []
        for key in self.keys:
            cells = [key, *(format_metric("sqnr_db", r.sites[key][main]) for r in self.runs),
                     *(f"{self.delta(key, main, i):+.2f}" for i in range(1, len(self.runs))),
                     *(self.change(key, i) for i in range(1, len(self.runs)))]
            if self.kind == "scan":
                cells += [format_metric("deadzone", r.sites[key]["deadzone"]) for r in self.runs]
            else:
                cells += [r.sites[key]["rank"] for r in self.runs]
            body.append(cells)
        return _table(head, body)


def compare_runs(paths: list[str | os.PathLike[str]], *, labels: list[str] | None = None,
                 threshold_db: float = DEFAULT_THRESHOLD_DB) -> RunComparison:
    """Read result folders (or their JSON files) of one model and one kind, align their sites by
    name and compare every later run with the first (see the module docstring).

    Args:
        paths: two or more result folders (or report.json / sensitivity.json / parity.json).
        labels: a short name per run (default: each folder's name, made unique).
        threshold_db: how far a site must move (in dB) to count as worse or better.
    """
    if len(paths) < 2:
        raise UserError("give at least two result folders to compare")
    if not (isinstance(threshold_db, int | float) and math.isfinite(threshold_db) and threshold_db >= 0):
        raise UserError(f"threshold {threshold_db!r}: give a non-negative number of dB, e.g. 1")
    names = list(labels) if labels is not None else _labels([Path(p) for p in paths])
    if len(names) != len(paths) or len(set(names)) != len(names):
        raise UserError(f"labels {names}: give one distinct label per result folder")
    runs = [_read(Path(p), name) for p, name in zip(paths, names, strict=True)]
    kinds = {r.kind for r in runs}
    if len(kinds) > 1:
        raise UserError("these results cannot be compared: " + ", ".join(
            f"{r.path} is a {r.kind} result" for r in runs) + "; give results of one kind")
    if runs[0].kind == "sensitivity":
        measures = {r.label: r.meta.get("measure") for r in runs}
        if len(set(measures.values())) > 1:
            raise UserError(f"the sensitivity results measure different things ({measures}): "
                            "compare runs on the same kind of model")
    _check_same_model(runs)
    shared = [k for k in runs[0].sites if all(k in r.sites for r in runs[1:])]
    only = {r.label: [k for k in r.sites if not all(k in o.sites for o in runs if o is not r)]
            for r in runs}
    return RunComparison(runs[0].kind, runs, float(threshold_db), shared, only)


def _labels(paths: list[Path]) -> list[str]:
    """Folder names (the file's folder for a JSON path), suffixed where two are equal."""
    base = [(p.parent if p.suffix == ".json" else p).resolve().name or str(p) for p in paths]
    return [b if base.count(b) == 1 else f"{b}#{i + 1}" for i, b in enumerate(base)]


def _find(path: Path) -> tuple[Path, str]:
    if path.is_dir():
        found = [(path / name, kind) for name, kind in RESULT_FILES.items() if (path / name).is_file()]
        if len(found) == 1:
            return found[0]
        if found:
            raise UserError(f"{path}: holds several results ({', '.join(p.name for p, _ in found)}); "
                            "give the JSON file of the one to compare")
        inside = sorted(p.name for p in path.iterdir() if p.is_dir()
                        and any((p / name).is_file() for name in RESULT_FILES))
        hint = (f"; its subfolders {', '.join(inside)} are (give one of them)" if inside else
                "; give a folder written by `qtransform scan`, `sensitivity` or `parity`")
        raise UserError(f"{path}: not a result folder (it holds none of {', '.join(RESULT_FILES)})"
                        + hint)
    if path.name in RESULT_FILES and path.is_file():
        return path, RESULT_FILES[path.name]
    if path.is_file():
        kind = _sniff(path)
        if kind:
            return path, kind
        raise UserError(f"{path}: not a qtransform result (give report.json, sensitivity.json, "
                        "parity.json or their folder)")
    raise UserError(f"{path}: no such result folder or file")


def _sniff(path: Path) -> str | None:
    """The kind of a renamed result file, read from its schema."""
    try:
        data = json.loads(qio.read_input_text(path, "result"))
    except ValueError:
        return None
    schema = data.get("schema") if isinstance(data, dict) else None
    return {"qtransform.scan_report": "scan", "qtransform.sensitivity": "sensitivity"}.get(schema)


def _read(path: Path, label: str) -> Run:
    file, kind = _find(path)
    if kind == "scan":
        report = ScanReport.load(file)
        sites = {}
        for row in report.rows:
            sites[_key(row.site, row.point)] = {
                **{m: row.metrics[m] for m in SCAN_METRICS}, "shape": row.shape,
                "layer": row.layer, "role": row.role, "flags": report.row_problems(row)}
        return Run(kind, file, label, dict(report.meta), sites)
    if kind == "sensitivity":
        sens = SensitivityReport.load(file)
        sites = {r.site: {"score": r.score(), "score_db": _db(r.score()), "rank": r.rank,
                          "shape": [r.params], "layer": r.layer, "role": r.role} for r in sens.rows}
        return Run(kind, file, label, dict(sens.meta), sites)
    return _read_parity(file, label)


def _read_parity(file: Path, label: str) -> Run:
    try:
        data = json.loads(qio.read_input_text(file, "parity report"))
        metrics = {k: float(v) for k, v in data["metrics"].items()}
        sites = {a["site"]: {"score": float(a["added"]), "score_db": _db(float(a["added"])),
                             "rank": int(a["rank"]), "shape": None, "layer": None, "role": None}
                 for a in data.get("attribution") or []}
        meta = dict(data.get("meta") or {})
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{file}: not a parity report this qtransform version can read "
                        f"({type(exc).__name__}: {exc}); re-run `qtransform parity`") from None
    return Run("parity", file, label, meta, sites, metrics)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _key(site: str, point: str) -> str:
    return site if point == "weight" else f"{site} [{point}]"


def _db(score: float) -> float:
    """A score as dB (10·log10): ratios of two runs become differences. Zero or less: -inf."""
    return 10 * math.log10(score) if score > 0 else (-math.inf if score == 0 else math.nan)


def _check_same_model(runs: list[Run]) -> None:
    """Runs must share sites, with equal shapes where both know them: else they are of
    different models, and the error names the sites that differ."""
    first = runs[0]
    for run in runs[1:]:
        shared = [k for k in first.sites if k in run.sites]
        reshaped = [k for k in shared if first.sites[k]["shape"] != run.sites[k]["shape"]]
        if reshaped:
            raise UserError(f"{first.label} and {run.label} are results of different models: "
                            + ", ".join(f"{k} is {_size(first, k)} in {first.label} but "
                                        f"{_size(run, k)} in {run.label}"
                                        for k in reshaped[:_SHOWN])
                            + _more(reshaped) + "; compare results of one model")
        if not shared and (first.sites or run.sites):
            mine = list(first.sites)
            theirs = list(run.sites)
            raise UserError(f"{first.label} and {run.label} are results of different models: no "
                            f"site in common ({first.label} has {', '.join(mine[:_SHOWN])}{_more(mine)}; "
                            f"{run.label} has {', '.join(theirs[:_SHOWN])}{_more(theirs)}); "
                            "compare results of one model")


def _size(run: Run, key: str) -> str:
    """"64x64" (scans: the tensor's shape) or "4096 weights" (sensitivity: the site's size)."""
    shape = run.sites[key]["shape"]
    return "x".join(map(str, shape)) if run.kind == "scan" else f"{shape[0]} weights"


def _more(items: list[str]) -> str:
    return f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""


def _describe(run: Run) -> str:
    m = run.meta
    if run.kind == "parity":
        return f"model {m.get('model')}, engine {m.get('engine')}, policy {m.get('policy_path') or 'n/a'}"
    what = m.get("kind", "sensitivity") if run.kind == "scan" else f"sensitivity ({m.get('method')})"
    return f"{what} of {m.get('source')} under {m.get('format')}"


def _table(head: list[Any], body: list[list[Any]]) -> list[str]:
    def esc(v: object) -> str:
        return str(v).replace("|", "\\|")

    return ["| " + " | ".join(esc(h) for h in head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(esc(v) for v in row) + " |" for row in body]
