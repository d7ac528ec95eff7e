"""`ScanReport`: the result of a scan and its problems, as data (files: `qtransform.scan.render`).

The report does not import its renderer: the renderer reads recommendations, which read reports,
so `save` and `markdown` reach it through `register_renderer`, which `scan/render.py` calls when
it loads (the `qtransform.scan` package loads it), as passes register with the pipeline.

One report type serves weight scans and activation scans: a row is one (site, point) with the
full metric set and the raw accumulator state, so reports can be re-aggregated (per layer, per
model) after loading without losing precision. The JSON schema is documented in docs/metrics.md;
derived parts (problems, per-layer summary) are recomputed on load, so editing the
thresholds of a saved report and loading it again gives a consistent report.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.core.metrics import ErrorStats
from qtransform.errors import UserError
from qtransform.scan.problems import (
    CHECKED,
    CHECKS,
    DEFAULT_THRESHOLDS,
    absolute,
    against_expected,
    check_flagging,
    expected_limit,
    robust_outliers,
)
from qtransform.schemas import load_policy

SCHEMA = "qtransform.scan_report"
SCHEMA_VERSION = "1"
VERSION = version("qtransform")
_POINT_ORDER = {"weight": 0, "input": 1, "output": 2}



@dataclass(frozen=True)
class Renderer:
    """What writes a report's files: `save(report, out_dir)` and its Markdown text."""

    save: Callable[[ScanReport, str | os.PathLike[str]], dict[str, Path]]
    markdown: Callable[[ScanReport], str]


_renderer: list[Renderer] = []


def register_renderer(renderer: Renderer) -> None:
    """Make `renderer` the one `ScanReport.save` and `markdown` use (scan/render.py, on import)."""
    _renderer[:] = [renderer]


def _rendering() -> Renderer:
    if not _renderer:
        raise RuntimeError("no ScanReport renderer registered: import qtransform.scan")
    return _renderer[0]


def _decode_numbers(values: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if v in ("inf", "-inf", "nan") else v for k, v in values.items()}


def build_meta(*, kind: str, source: str, fmt: str, options: dict[str, Any], **extra: object) -> dict[str, Any]:
    """Report metadata: what was measured, with which numerics, by which version, when."""
    return {
        "kind": kind,
        "source": source,
        "format": fmt,
        "options": options,
        "scale_rule": options.get("scale_rule"),
        "qtransform_version": VERSION,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


@dataclass
class SiteRow:
    """One measured (site, point): identity, numerics, metrics and the raw accumulator."""

    site: str
    point: str  # weight | input | output; attention sites: query | key | value | probs
    layer: int | None
    role: str
    kind: str
    shape: list[int]
    format: str
    options: dict[str, Any]
    metrics: dict[str, float]
    state: dict[str, float]
    block_exponents: dict[str, Any] | None = None
    # fused experts: one entry per expert, {"expert", "tokens" (activation scans), "metrics",
    # "state" (raw sums)}; an expert that saw no calibration token has "tokens": 0 and
    # "metrics" and "state" None
    experts: list[dict[str, Any]] | None = None
    diagnostics: dict[str, float] | None = None  # weight scans: outlier channels (problem reasons)
    # weight scans given a rotation to try (scan/remedy.py): label -> {"metrics", "state"} of
    # the format's error on the rotated weight W·R (the same SQNR and MSE as on W); key/value
    # rows of an activation scan: the finer KV scales measured on the same tensors, with the
    # rule they rewrite ("rule", "fields", "engine", "rank": scan/kv_remedy.py)
    remedies: dict[str, dict[str, Any]] | None = None
    # attention sites: one entry per head, {"head", "metrics", "state"}
    heads: list[dict[str, Any]] | None = None

    @classmethod
    def from_stats(
        cls, site: str, point: str, stats: ErrorStats, *, layer: int | None, role: str, kind: str,
        shape: list[int], fmt: str, options: dict[str, Any], block_exponents: dict[str, Any] | None = None,
    ) -> SiteRow:
        return cls(site, point, layer, role, kind, list(shape), fmt, dict(options),
                   stats.result(), stats.state(), block_exponents)

    @property
    def label(self) -> str:
        return self.site if self.point == "weight" else f"{self.site} [{self.point}]"

    def stats(self) -> ErrorStats:
        return ErrorStats.from_state(self.state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self.site, "point": self.point, "layer": self.layer, "role": self.role,
            "kind": self.kind, "shape": self.shape, "format": self.format, "options": self.options,
            "metrics": self.metrics, "state": self.state, "block_exponents": self.block_exponents,
            **({"experts": self.experts} if self.experts is not None else {}),
            **({"heads": self.heads} if self.heads is not None else {}),
            "diagnostics": self.diagnostics,
            **({"remedies": self.remedies} if self.remedies is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteRow:
        return cls(
            d["site"], d["point"], d["layer"], d["role"], d["kind"], list(d["shape"]), d["format"],
            dict(d["options"]), _decode_numbers(d["metrics"]), _decode_numbers(d["state"]),
            d.get("block_exponents"),
            [{**e, "metrics": _decode_numbers(e["metrics"]) if e.get("metrics") else None,
              "state": _decode_numbers(e["state"]) if e.get("state") else None}
             for e in d["experts"]] if d.get("experts") is not None else None,
            _decode_numbers(d["diagnostics"]) if d.get("diagnostics") else None,
            {label: {**r, "metrics": _decode_numbers(r["metrics"]), "state": _decode_numbers(r["state"])}
             for label, r in d["remedies"].items()} if d.get("remedies") else None,
            [{**h, "metrics": _decode_numbers(h["metrics"]) if h.get("metrics") else None,
              "state": _decode_numbers(h["state"]) if h.get("state") else None}
             for h in d["heads"]] if d.get("heads") is not None else None,
        )


@dataclass
class ScanReport:
    """Rows of one scan, the thresholds that flag problems, and metadata (see `build_meta`)."""

    meta: dict[str, Any]
    rows: list[SiteRow]
    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    flagging: str = "expected"  # or "absolute" (docs/metrics.md)
    _cache: tuple | None = field(default=None, repr=False, compare=False)

    # -- problems -----------------------------------------------------------------------------
    def row_problems(self, row: SiteRow) -> list[str]:
        """Why a row is problematic (empty when it is fine). NaN metrics flag nothing."""
        return self._problems().get(id(row), [])

    def _problems(self) -> dict[int, list[str]]:
        """Reasons per row (by id), computed once per state of rows, thresholds and flagging."""
        key = (self.flagging, tuple(sorted(self.thresholds.items())),
               tuple((id(r), r.format, *(r.metrics.get(k) for k in CHECKED)) for r in self.rows))
        if self._cache is None or self._cache[0] != key:
            t = {**DEFAULT_THRESHOLDS, **self.thresholds}
            if self.flagging == "absolute":
                found = {id(r): absolute(r, t) for r in self.rows}
            else:
                outliers = robust_outliers(self.rows, t)
                found = {id(r): against_expected(r, t, outliers.get(id(r))) for r in self.rows}
            self._cache = (key, {k: v for k, v in found.items() if v})
        return self._cache[1]

    def flag_limit(self, row: SiteRow, metric: str) -> float | None:
        """The value beyond which `metric` flags `row` under this report's rule: the absolute
        threshold, or (flagging="expected") the format's Gaussian baseline for the row's block
        structure moved by the margin; None where the rule has no limit for the row (an output
        point under "expected": flagged as a robust outlier only). Plots draw this very value."""
        check = next(c for c in CHECKS if c.metric == metric)
        t = {**DEFAULT_THRESHOLDS, **self.thresholds}
        if self.flagging == "absolute":
            return t[check.threshold]
        return expected_limit(row, check, t)

    def over_limits(self, row: SiteRow) -> set[str]:
        """The metrics of `row` beyond their `flag_limit` (robust-outlier flags aside)."""
        return {c.metric for c in CHECKS if (limit := self.flag_limit(row, c.metric)) is not None
                and c.worse(row.metrics[c.metric], limit)}

    def problems(self) -> list[tuple[SiteRow, list[str]]]:
        """Every problematic row with its reasons, in row order."""
        found = self._problems()
        return [(row, found[id(row)]) for row in self.rows if id(row) in found]

    def layers(self) -> list[int]:
        """Decoder-layer indices that have at least one row."""
        return sorted({r.layer for r in self.rows if r.layer is not None})

    def problematic_layers(self) -> list[int]:
        """Layers with at least one problematic site (a layer is as bad as its worst site)."""
        return sorted({row.layer for row, _ in self.problems() if row.layer is not None})

    # -- aggregation --------------------------------------------------------------------------
    def aggregate(self, rows: list[SiteRow] | None = None) -> dict[str, float]:
        """Metrics of the rows' errors summed up (never an average of per-row dB values)."""
        total = ErrorStats()
        for row in self.rows if rows is None else rows:
            total.merge(row.stats())
        return total.result()

    def points(self) -> list[str]:
        """The measured point kinds (weight, input, output), in that order."""
        return sorted({r.point for r in self.rows}, key=lambda p: (_POINT_ORDER.get(p, 3), p))

    def layer_summary(self) -> list[dict[str, Any]]:
        """One entry per (layer, point kind): summed metrics, worst site, problematic sites.
        Point kinds are never pooled: a layer's output error says nothing of its weights'."""
        bad = {id(row) for row, _ in self.problems()}
        out = []
        for layer in self.layers():
            for point in self.points():
                rows = [r for r in self.rows if r.layer == layer and r.point == point]
                if not rows:
                    continue
                worst = min(rows, key=lambda r: _sort_key(r.metrics["sqnr_db"]))
                out.append({
                    "layer": layer, "point": point, "sites": len(rows), **_pick(self.aggregate(rows)),
                    "worst_site": worst.site, "worst_sqnr_db": worst.metrics["sqnr_db"],
                    "problem_sites": sum(id(r) in bad for r in rows),
                })
        return out

    def expert_summary(self) -> list[dict[str, Any]]:
        """Per (layer, point, expert) of the fused experts rows: the expert's errors merged over
        the layer's experts sites (its gate_up and down matrices), its calibration tokens (the
        most any of those sites saw; None in weight scans) and `metrics` None for an expert that
        no calibration token reached. Expert e of one layer is not expert e of another, so
        experts are never merged across layers."""
        groups: dict[tuple[Any, str, int], dict[str, Any]] = {}
        for row in self.rows:
            for entry in row.experts or ():
                key = (row.layer, row.point, int(entry["expert"]))
                group = groups.setdefault(key, {"stats": ErrorStats(), "sites": 0, "tokens": None})
                group["sites"] += 1
                if entry.get("tokens") is not None:
                    group["tokens"] = max(group["tokens"] or 0, int(entry["tokens"]))
                if entry.get("state"):
                    group["stats"].merge(ErrorStats.from_state(entry["state"]))
        return [{"layer": layer, "point": point, "expert": expert, "sites": g["sites"],
                 "tokens": g["tokens"], "metrics": g["stats"].result() if g["stats"].n else None}
                for (layer, point, expert), g in sorted(groups.items(), key=lambda kv: (
                    kv[0][0] is None, kv[0][0] or 0, _POINT_ORDER.get(kv[0][1], 3), kv[0][1], kv[0][2]))]

    def layer_sqnr(self) -> dict[int, float]:
        """Per layer, the SQNR of all its measured errors merged (what AQN tiers rank)."""
        return {layer: self.aggregate([r for r in self.rows if r.layer == layer])["sqnr_db"]
                for layer in self.layers()}

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The report's data (rows, summary, per-layer table); renderers add the rest."""
        problems = {id(row): why for row, why in self.problems()}
        rows = [{**row.to_dict(), "problems": problems.get(id(row), [])} for row in self.rows]
        summary = {
            "sites": len(self.rows), "layers": len(self.layers()),
            "problematic_sites": len(problems), "problematic_layers": self.problematic_layers(),
            "total": self.aggregate() if self.rows else {},
        }
        return encode_floats({
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "meta": self.meta,
            "flagging": self.flagging, "thresholds": self.thresholds, "summary": summary,
            "layers": self.layer_summary(), "rows": rows,
        })

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScanReport:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a qtransform scan report (schema {data.get('schema')!r})")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"unsupported scan report version {data.get('schema_version')!r}; "
                             f"this qtransform reads version {SCHEMA_VERSION}")
        return cls(dict(data["meta"]), [SiteRow.from_dict(r) for r in data["rows"]],
                   _decode_numbers(data["thresholds"]),
                   check_flagging(data.get("flagging", "absolute")))  # reports before it: absolute

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """Write report.json, report.csv, report.md and report.png into out_dir (see `render`)."""
        return _rendering().save(self, out_dir)

    def markdown(self) -> str:
        """report.md's text: summary, recommendation, per-layer and per-site tables."""
        return _rendering().markdown(self)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ScanReport:
        """Read report.json (or the folder `save` wrote)."""
        p = Path(path)
        if p.is_dir():
            p = p / "report.json"
        text = qio.read_input_text(p, "report (give report.json or the folder `qtransform scan` wrote)")
        try:
            report = cls.from_dict(json.loads(text))
            # what recommendations read, touched here: a crafted report fails as the user's data
            # now, and an error in `recommend` or `guide` later is a bug of qtransform's own
            report.aggregate()
            report.layer_summary()
            report.problems()
            rules = report.meta.get("quantize")
            if rules is not None or report.meta.get("rotate"):
                load_policy({"version": 1, "quantize": rules or [], "rotate": report.meta.get("rotate") or []})
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise UserError(f"{p}: not a scan report this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                            "re-run `qtransform scan`") from None
        return report



def _pick(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics[k] for k in ("sqnr_db", "rel_rmse", "cosine", "deadzone", "saturation", "mean_rel_error")}


def _sort_key(value: float) -> float:
    return math.inf if math.isnan(value) else value


