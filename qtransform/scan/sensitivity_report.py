"""`SensitivityReport`: sites ranked by end-to-end sensitivity, as data and its files.

The measurement (`qtransform.scan.sensitivity`) fills it; budgets (`qtransform.scan.budget`)
read it; `load` checks what they read once, so a damaged file fails as the user's data. Files:
sensitivity.json (the data), .csv, .md and .png (sites by layer index, the most sensitive named).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.errors import UserError
from qtransform.formats.expected import effective_bits
from qtransform.schemas import load_policy

SCHEMA = "qtransform.sensitivity"
SCHEMA_VERSION = "1"
FILES = ("sensitivity.json", "sensitivity.csv", "sensitivity.md", "sensitivity.png")
LABELED = 8  # sites named on the sensitivity plot

@dataclass
class SensitivityRow:
    """One site: what quantizing it alone does to the model (`exact`) and the estimate of it."""

    site: str
    layer: int | None
    role: str
    params: int  # weight elements (what keeping the site in high precision costs)
    format: str
    options: dict[str, Any]
    points: list[str]
    exact: float = math.nan  # mean KL per token (causal LM) or output nsr
    estimate: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)  # encoders: sqnr_db, mean_token_cosine
    rotated: float = math.nan  # exact, with the rotation of meta["rotation"] on the site's input
    rank: int | None = None  # 1 = most sensitive, by exact (else by estimate)
    estimate_rank: int | None = None

    def score(self) -> float:
        return self.exact if not math.isnan(self.exact) else self.estimate


@dataclass
class SensitivityReport:
    """Sites ranked by end-to-end sensitivity, with how it was measured (`meta`)."""

    meta: dict[str, Any]
    rows: list[SensitivityRow]

    @property
    def measure(self) -> str:
        return str(self.meta["measure"])

    def ranked(self) -> list[SensitivityRow]:
        return sorted(self.rows, key=lambda r: r.rank or len(self.rows) + 1)

    def to_dict(self) -> dict[str, Any]:
        return encode_floats({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "meta": self.meta,
                              "rows": [dict(r.__dict__) for r in self.ranked()]})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SensitivityReport:
        p = Path(path)
        if p.is_dir():
            p = p / FILES[0]
        text = qio.read_input_text(p, "sensitivity report")
        try:
            data = json.loads(text)
            if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
                raise UserError(f"{p}: not a qtransform sensitivity report of version "
                                f"{SCHEMA_VERSION}; re-run `qtransform sensitivity`")
            decode = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
            rows = [SensitivityRow(**{k: decode.get(v, v) if isinstance(v, str) and k in ("exact", "estimate")
                                      else v for k, v in r.items()}) for r in data["rows"]]
            report = cls(dict(data["meta"]), rows)
            report.check()
        except UserError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{p}: not a sensitivity report this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                            "re-run `qtransform sensitivity`") from None
        return report

    def check(self) -> None:
        """Touch what budgets read (scores, sizes, formats, the rules, the calibration settings),
        so a damaged file fails as the user's data when it is loaded."""
        measure_label(self.measure)
        for row in self.rows:
            float(row.score())
            int(row.params)
            effective_bits(row.format, row.options)
        load_policy({"version": 1, "quantize": self.meta.get("quantize") or []})
        calibration = self.meta.get("calibration") or {}
        for key in ("batch_size", "max_length"):
            if key in calibration and not (isinstance(calibration[key], int) and calibration[key] > 0):
                raise ValueError(f"calibration.{key} {calibration[key]!r} is not a positive integer")

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """sensitivity.json, .csv, .md and .png (sites by layer), each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "json": qio.write_text(out / FILES[0], json.dumps(self.to_dict(), indent=2) + "\n"),
            "csv": qio.write_text(out / FILES[1], self.to_csv()),
            "md": qio.write_text(out / FILES[2], self.markdown()),
            "png": self.plot(out / FILES[3]),
        }

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["rank", "site", "layer", "role", "params", "format", "points",
                         f"{self.measure}_exact", f"{self.measure}_estimate", "estimate_rank",
                         f"{self.measure}_rotated"])
        for r in self.ranked():
            writer.writerow([r.rank, r.site, "" if r.layer is None else r.layer, r.role, r.params,
                             r.format, "+".join(r.points), r.exact, r.estimate,
                             "" if r.estimate_rank is None else r.estimate_rank, r.rotated])
        return buf.getvalue()

    def table(self, limit: int | None = None) -> list[str]:
        """Markdown table rows, most sensitive first (columns for the measures that were run)."""
        unit = measure_label(self.measure)
        cols = [k for k in ("exact", "estimate") if any(not math.isnan(getattr(r, k)) for r in self.rows)]
        both = len(cols) == 2
        rotation = self.meta.get("rotation")
        head = ["rank", "site", "layer", *(f"{unit} ({k})" for k in cols), *(["estimate rank"] if both else []),
                *([f"with {rotation}", "rotated / exact"] if rotation else [])]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.ranked()[:limit]:
            cells = [r.rank, r.site, "" if r.layer is None else r.layer,
                     *(_num(getattr(r, k)) for k in cols), *([r.estimate_rank] if both else []),
                     *([_num(r.rotated), _num(r.rotated / r.exact if r.exact else math.nan)] if rotation else [])]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        return lines

    def markdown(self) -> str:
        m = self.meta
        lines = [f"# Sensitivity: {m['format']} on {m['source']}", "",
                 f"- {len(self.rows)} sites, quantized one at a time ({'+'.join(m['points'])}); "
                 f"measure: {measure_label(self.measure)} of the {m['output']} on "
                 f"{m['calibration']['tokens']} calibration tokens",
                 f"- method: {m['method']}; {timing_text(m)}"]
        if m.get("spearman") is not None:
            lines.append(f"- estimate vs exact: Spearman {m['spearman']:.3f} over {len(self.rows)} sites")
        if m.get("rotation"):
            lines.append(f"- with {m['rotation']}: each site measured again with the rotation on its "
                         "input and weight (the rotate pass), its quantizers alone switched on; "
                         f"n/a where the rotation does not fit the site's input features")
        lines += ["", *self.table()]
        return "\n".join(lines) + "\n"

    def figure(self, labeled: int = LABELED) -> Any:
        """Sites by layer index (log scale), exact and estimate as separate marks; the `labeled`
        most sensitive sites named at their points, so the worst site is read off the picture."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # loaded only to draw (0.5 s)
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(10, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        rows = self.rows
        xs = [_x(r) for r in rows]
        for key, marker, label in (("exact", "o", "exact (one site quantized)"),
                                   ("estimate", "x", "estimate (one backward pass)")):
            ys = [getattr(r, key) for r in rows]
            if any(math.isfinite(y) and y > 0 for y in ys):
                ax.scatter(xs, [y if y > 0 else math.nan for y in ys], marker=marker, s=18,
                           alpha=0.7, label=label)
        worst = [r for r in self.ranked() if math.isfinite(r.score()) and r.score() > 0][:labeled]
        if worst:
            ax.scatter([_x(r) for r in worst], [r.score() for r in worst], s=60, facecolors="none",
                       edgecolors="tab:red", label=f"the {len(worst)} most sensitive, named")
        seen: dict[int, int] = {}
        for r in worst:  # labels of one layer stacked, so close scores stay readable
            k = seen[_x(r)] = seen.get(_x(r), -1) + 1
            ax.annotate(f"{r.rank}. {short_name(r.site)}", (_x(r), r.score()), xytext=(6, 4 - 10 * k),
                        textcoords="offset points", fontsize=7, color="tab:red")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yscale("log")
        ax.set_xlabel("layer index (-1: outside layers)")
        ax.set_ylabel(measure_label(self.measure))
        ax.set_title(f"Per-site sensitivity: {self.meta['format']} "
                     f"({'+'.join(self.meta['points'])}) on {Path(str(self.meta['source'])).name}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        return fig

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """sensitivity.png: `figure`, written atomically."""
        fig = self.figure()
        with qio.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
        return Path(path)


def short_name(site: str) -> str:
    """A site's name without the model prefix (`layers.3.self_attn.q_proj`), for labels."""
    for prefix in ("model.", "transformer.", "encoder."):
        if site.startswith(prefix):
            return site[len(prefix):]
    return site


def _x(row: SensitivityRow) -> int:
    return row.layer if row.layer is not None else -1


def measure_label(measure: str) -> str:
    return {"kl": "KL(fp‖q) per token", "nsr": "output noise/signal"}.get(measure, measure)


def timing_text(meta: dict[str, Any]) -> str:
    parts = []
    if meta.get("exact_seconds_per_site") is not None:
        parts.append(f"exact {meta['exact_seconds_per_site']:.3f} s per site")
    if meta.get("estimate_seconds") is not None:
        parts.append(f"estimate {meta['estimate_seconds']:.2f} s for all sites")
    return ", ".join(parts)


def _num(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.4g}"
