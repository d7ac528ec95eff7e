"""`ScanReport`: the result of a scan, its problems, and its files (JSON, CSV, Markdown, PNG).

One report type serves weight scans and activation scans: a row is one (site, point) with the
full metric set and the raw accumulator state, so reports can be re-aggregated (per layer, per
model) after loading without losing precision. The JSON schema is documented in docs/metrics.md;
derived parts (problems, per-layer summary, recommendation) are recomputed on load, so editing the
thresholds of a saved report and loading it again gives a consistent report.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtransform import io as qio
from qtransform.errors import UserError
from qtransform.metrics import ErrorStats

SCHEMA = "qtransform.scan_report"
SCHEMA_VERSION = "1"
DEFAULT_THRESHOLDS = {"sqnr_db": 20.0, "deadzone": 0.05, "saturation": 0.01, "relative_error": 0.10}
FILES = ("report.json", "report.csv", "report.md", "report.png")
_PERCENT = ("rel_rmse", "deadzone", "saturation", "mean_rel_error")
_CSV_METRICS = (
    "sqnr_db", "mse", "rmse", "rel_rmse", "cosine", "max_abs_error", "deadzone", "saturation",
    "mean_rel_error", "kurtosis_orig", "kurtosis_quant", "n", "nonzero", "deadzone_count",
    "saturated_count", "nan_orig", "nan_quant", "nonfinite",
)


def encode_floats(obj: Any) -> Any:
    """Strict-JSON copy of obj: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_floats(v) for v in obj]
    return obj


def _decode_numbers(values: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if v in ("inf", "-inf", "nan") else v for k, v in values.items()}


def build_meta(*, kind: str, source: str, fmt: str, options: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Report metadata: what was measured, with which numerics, by which version, when."""
    import torch

    import qtransform

    return {
        "kind": kind,
        "source": source,
        "format": fmt,
        "options": options,
        "scale_rule": options.get("scale_rule"),
        "qtransform_version": qtransform.__version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


@dataclass
class SiteRow:
    """One measured (site, point): identity, numerics, metrics and the raw accumulator."""

    site: str
    point: str  # weight | input | output
    layer: int | None
    role: str
    kind: str
    shape: list[int]
    format: str
    options: dict[str, Any]
    metrics: dict[str, float]
    state: dict[str, float]
    block_exponents: dict[str, Any] | None = None

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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteRow:
        return cls(
            d["site"], d["point"], d["layer"], d["role"], d["kind"], list(d["shape"]), d["format"],
            dict(d["options"]), _decode_numbers(d["metrics"]), _decode_numbers(d["state"]),
            d.get("block_exponents"),
        )


@dataclass
class ScanReport:
    """Rows of one scan, the thresholds that flag problems, and metadata (see `build_meta`)."""

    meta: dict[str, Any]
    rows: list[SiteRow]
    thresholds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))

    # -- problems -----------------------------------------------------------------------------
    def row_problems(self, row: SiteRow) -> list[str]:
        """Why a row is problematic (empty when it is fine). NaN metrics flag nothing."""
        m, t = row.metrics, {**DEFAULT_THRESHOLDS, **self.thresholds}
        out = []
        if m["sqnr_db"] < t["sqnr_db"]:
            out.append(f"SQNR {m['sqnr_db']:.2f} dB < {t['sqnr_db']:g} dB")
        if m["deadzone"] > t["deadzone"]:
            out.append(f"deadzone {100 * m['deadzone']:.2f} % > {100 * t['deadzone']:g} %")
        if m["saturation"] > t["saturation"]:
            out.append(f"saturation {100 * m['saturation']:.2f} % > {100 * t['saturation']:g} %")
        if m["rel_rmse"] > t["relative_error"]:
            out.append(f"rel_rmse {100 * m['rel_rmse']:.2f} % > {100 * t['relative_error']:g} %")
        if m["nan_quant"] > m["nan_orig"]:
            out.append(f"{int(m['nan_quant'] - m['nan_orig'])} NaN values created by quantization")
        return out

    def problems(self) -> list[tuple[SiteRow, list[str]]]:
        """Every problematic row with its reasons, in row order."""
        return [(row, why) for row in self.rows if (why := self.row_problems(row))]

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

    def layer_summary(self) -> list[dict[str, Any]]:
        """One entry per layer: summed metrics, worst site, number of problematic sites."""
        bad = {id(row) for row, _ in self.problems()}
        out = []
        for layer in self.layers():
            rows = [r for r in self.rows if r.layer == layer]
            worst = min(rows, key=lambda r: _sort_key(r.metrics["sqnr_db"]))
            out.append({
                "layer": layer, "sites": len(rows), **_pick(self.aggregate(rows)),
                "worst_site": worst.label, "worst_sqnr_db": worst.metrics["sqnr_db"],
                "problem_sites": sum(id(r) in bad for r in rows),
            })
        return out

    def layer_sqnr(self) -> dict[int, float]:
        return {e["layer"]: e["sqnr_db"] for e in self.layer_summary()}

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        from qtransform.recommend import recommend

        problems = {id(row): why for row, why in self.problems()}
        rows = [{**row.to_dict(), "problems": problems.get(id(row), [])} for row in self.rows]
        summary = {
            "sites": len(self.rows), "layers": len(self.layers()),
            "problematic_sites": len(problems), "problematic_layers": self.problematic_layers(),
            "total": self.aggregate() if self.rows else {},
        }
        return encode_floats({
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "meta": self.meta,
            "thresholds": self.thresholds, "summary": summary,
            "recommendation": recommend(self).to_dict(), "layers": self.layer_summary(), "rows": rows,
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
                   _decode_numbers(data["thresholds"]))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ScanReport:
        """Read report.json (or the folder `save` wrote)."""
        p = Path(path)
        if p.is_dir():
            p = p / "report.json"
        text = qio.read_input_text(p, "report (give report.json or the folder `qtransform scan` wrote)")
        try:
            report = cls.from_dict(json.loads(text))
            report.aggregate()  # touches every row's sums: a crafted row fails here, not later
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise UserError(f"{p}: not a scan report this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc)[:200]}); re-run `qtransform scan`") from None
        return report

    def to_csv(self) -> str:
        """One line per row; metrics as plain numbers (inf/nan as Python spells them)."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["site", "point", "layer", "role", "kind", "shape", "format", *_CSV_METRICS,
                         "block_exp_min", "block_exp_max", "problematic", "problems"])
        for row in self.rows:
            why = self.row_problems(row)
            exps = row.block_exponents or {}
            writer.writerow([
                row.site, row.point, "" if row.layer is None else row.layer, row.role, row.kind,
                "x".join(map(str, row.shape)), row.format, *(row.metrics[k] for k in _CSV_METRICS),
                exps.get("min", ""), exps.get("max", ""), int(bool(why)), "; ".join(why),
            ])
        return buf.getvalue()

    def to_markdown(self) -> str:
        """A human-readable report: summary, recommendation, per-layer and per-site tables."""
        from qtransform.recommend import recommend

        rec = recommend(self)
        opts = ", ".join(f"{k}={v}" for k, v in self.meta.get("options", {}).items())
        total = self.aggregate() if self.rows else {}
        lines = [
            f"# Scan report: {self.meta.get('format')} on {self.meta.get('source')}", "",
            f"- kind: {self.meta.get('kind')}; options: {opts or 'per site'}",
            f"- qtransform {self.meta.get('qtransform_version')}, created {self.meta.get('created')}",
            "- thresholds: " + ", ".join(f"{k} {v:g}" for k, v in self.thresholds.items()),
            f"- {len(self.rows)} sites in {len(self.layers())} layers; "
            f"{len(self.problems())} problematic sites; problematic layers: "
            f"{_ranges(self.problematic_layers()) or 'none'}",
        ]
        if total:
            lines.append("- whole model: " + ", ".join(
                f"{k} {format_metric(k, total[k])}" for k in ("sqnr_db", "rel_rmse", "cosine", "deadzone", "saturation")))
        lines += ["", "## Recommendation", "", rec.text, "", "```json",
                  json.dumps(rec.policy, indent=2), "```", "", "## Layers", ""]
        lines += _md_table(
            ["layer", "sites", "SQNR dB", "worst site", "worst SQNR dB", "rel_rmse", "deadzone",
             "saturation", "problem sites"],
            [[e["layer"], e["sites"], format_metric("sqnr_db", e["sqnr_db"]), e["worst_site"],
              format_metric("sqnr_db", e["worst_sqnr_db"]), format_metric("rel_rmse", e["rel_rmse"]),
              format_metric("deadzone", e["deadzone"]), format_metric("saturation", e["saturation"]), e["problem_sites"]]
             for e in self.layer_summary()],
        )
        lines += ["", "## Sites", ""]
        lines += _md_table(
            ["site", "layer", "role", "shape", "SQNR dB", "rel_rmse", "cosine", "max err",
             "deadzone", "saturation", "mean rel err*", "problems"],
            [[r.label, "" if r.layer is None else r.layer, r.role, "x".join(map(str, r.shape)),
              *(format_metric(k, r.metrics[k]) for k in ("sqnr_db", "rel_rmse", "cosine", "max_abs_error",
                                                  "deadzone", "saturation", "mean_rel_error")),
              "; ".join(self.row_problems(r))] for r in self.rows],
        )
        lines += ["", "*mean relative error is dominated by small values that quantize to zero; "
                  "it is reported for comparison with older SRDD scans only (docs/metrics.md)."]
        return "\n".join(lines) + "\n"

    def plot_png(self, path: str | os.PathLike[str]) -> Path:
        """Per-site SQNR and deadzone by layer index, layer totals as lines, thresholds dashed."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        fig = Figure(figsize=(10, 6.5), layout="constrained")
        FigureCanvasAgg(fig)  # render with Agg without touching pyplot's global backend
        top, bottom = fig.subplots(2, 1, sharex=True)
        layered = [r for r in self.rows if r.layer is not None]
        rows = layered or self.rows
        xs = [r.layer if layered else i for i, r in enumerate(rows)]
        summary = self.layer_summary() if layered else []
        colors = ["tab:red" if self.row_problems(r) else "tab:blue" for r in rows]
        for ax, key, scale, unit, thr in (
            (top, "sqnr_db", 1.0, "SQNR (dB)", self.thresholds["sqnr_db"]),
            (bottom, "deadzone", 100.0, "deadzone (%)", 100.0 * self.thresholds["deadzone"]),
        ):
            ys = [_finite(r.metrics[key]) * scale for r in rows]
            ax.scatter(xs, ys, s=12, alpha=0.6, c=colors, label="site (red: problematic)")
            if summary:
                ax.plot([e["layer"] for e in summary], [_finite(e[key]) * scale for e in summary],
                        color="black", linewidth=1.2, label="layer total")
            ax.axhline(thr, color="red", linestyle="--", linewidth=1, label=f"threshold {thr:g}")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        bottom.set_xlabel("layer index" if layered else "site")
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        skipped = len(self.rows) - len(rows)
        top.set_title(f"{self.meta.get('format')} scan of {Path(str(self.meta.get('source'))).name}"
                      + (f" ({skipped} site(s) outside layers not shown)" if skipped else ""))
        with qio.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
        return Path(path)

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """Write report.json, report.csv, report.md and report.png into out_dir, each atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "json": qio.write_text(out / FILES[0], self.to_json() + "\n"),
            "csv": qio.write_text(out / FILES[1], self.to_csv()),
            "md": qio.write_text(out / FILES[2], self.to_markdown()),
            "png": self.plot_png(out / FILES[3]),
        }


def _pick(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics[k] for k in ("sqnr_db", "rel_rmse", "cosine", "deadzone", "saturation", "mean_rel_error")}


def _sort_key(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.nan


def format_metric(metric: str, value: float) -> str:
    """A metric as table text: percentages for ratios, dB with two decimals."""
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if metric in _PERCENT:
        return f"{100 * value:.2f} %"
    if metric == "sqnr_db":
        return f"{value:.2f}"
    if metric == "cosine":
        return f"{value:.6f}"
    return f"{value:.4g}"


def _ranges(layers: list[int]) -> str:
    from qtransform.schemas.selectors import format_layers

    return format_layers(layers) if layers else ""


def _md_table(head: list[str], body: list[list[Any]]) -> list[str]:
    def esc(v: Any) -> str:
        return str(v).replace("|", "\\|")

    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(esc(v) for v in row) + " |" for row in body
    ]
