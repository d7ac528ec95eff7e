"""`ScanReport`: the result of a scan and its problems, as data (files: `qtransform.scan.render`).

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
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.core.metrics import ErrorStats
from qtransform.errors import UserError
from qtransform.scan import render

SCHEMA = "qtransform.scan_report"
SCHEMA_VERSION = "1"
VERSION = version("qtransform")
DEFAULT_THRESHOLDS = {"sqnr_db": 20.0, "deadzone": 0.05, "saturation": 0.01, "relative_error": 0.10}


def _decode_numbers(values: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if v in ("inf", "-inf", "nan") else v for k, v in values.items()}


def build_meta(*, kind: str, source: str, fmt: str, options: dict[str, Any], **extra: Any) -> dict[str, Any]:
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
    # fused experts: one entry per expert, {"expert", "tokens" (activation scans), "metrics"};
    # an expert that saw no calibration token has "tokens": 0 and "metrics": None
    experts: list[dict[str, Any]] | None = None

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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiteRow:
        return cls(
            d["site"], d["point"], d["layer"], d["role"], d["kind"], list(d["shape"]), d["format"],
            dict(d["options"]), _decode_numbers(d["metrics"]), _decode_numbers(d["state"]),
            d.get("block_exponents"),
            [{**e, "metrics": _decode_numbers(e["metrics"]) if e.get("metrics") else None}
             for e in d["experts"]] if d.get("experts") is not None else None,
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
            "thresholds": self.thresholds, "summary": summary,
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
                   _decode_numbers(data["thresholds"]))

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """Write report.json, report.csv, report.md and report.png into out_dir (see `render`)."""
        return render.save_report(self, out_dir)

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



def _pick(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics[k] for k in ("sqnr_db", "rel_rmse", "cosine", "deadzone", "saturation", "mean_rel_error")}


def _sort_key(value: float) -> float:
    return math.inf if math.isnan(value) else value
