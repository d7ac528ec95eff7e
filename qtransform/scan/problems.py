"""What makes a scanned site a problem: the checks (SQNR, deadzone, saturation, relative
error), the two flagging rules (fixed thresholds, or worse than the format does to Gaussian data
of the same block structure, with the sampling noise of small tensors), robust outliers among a
model's sites, NaN created by quantization, and the likely cause in words. `ScanReport` applies
them to its rows (docs/metrics.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qtransform import formats
from qtransform.errors import UserError
from qtransform.formats.expected import expected_error

if TYPE_CHECKING:
    from qtransform.scan.report import SiteRow

ABSOLUTE_THRESHOLDS = {"sqnr_db": 20.0, "deadzone": 0.05, "saturation": 0.01, "relative_error": 0.10}
EXPECTED_MARGINS = {  # flagging="expected": how much worse than the format's Gaussian baseline
    "sqnr_margin_db": 3.0, "deadzone_margin": 0.05, "saturation_margin": 0.01,
    "outlier_z": 4.0, "outlier_min_db": 1.0,
}
DEFAULT_THRESHOLDS = {**ABSOLUTE_THRESHOLDS, **EXPECTED_MARGINS}
FLAGGING = ("expected", "absolute")
HEAVY_TAIL_KURTOSIS = 10.0  # Pearson kurtosis: 3 for a Gaussian; above this, tails dominate blocks

EXPECTED_POINTS = ("weight", "input")  # points quantized directly (outputs: local error of a product)


@dataclass(frozen=True)
class Check:
    """One problem check: a metric, which direction is good, its absolute threshold key and (for
    flagging="expected") the key of its allowed margin beyond the format's Gaussian baseline."""

    metric: str
    threshold: str
    higher_is_better: bool
    margin: str | None
    label: str
    percent: bool

    def text(self, value: float) -> str:
        return f"{100 * value:.2f} %" if self.percent else f"{value:.2f} dB"

    def worse(self, value: float, limit: float) -> bool:
        """NaN compares false: an undefined metric flags nothing."""
        return value < limit if self.higher_is_better else value > limit

    def limit(self, expected: float, margin: float) -> float:
        return expected - margin if self.higher_is_better else expected + margin


CHECKS = (
    Check("sqnr_db", "sqnr_db", True, "sqnr_margin_db", "SQNR", False),
    Check("deadzone", "deadzone", False, "deadzone_margin", "deadzone", True),
    Check("saturation", "saturation", False, "saturation_margin", "saturation", True),
    Check("rel_rmse", "relative_error", False, None, "rel_rmse", True),  # = SQNR for zero-mean data
)


CHECKED = ("sqnr_db", "deadzone", "saturation", "rel_rmse", "nan_quant", "nan_orig")


def check_flagging(flagging: str) -> str:
    if flagging not in FLAGGING:
        raise UserError(f"flagging {flagging!r}: use 'expected' (against the format's error on "
                        "Gaussian data, the default) or 'absolute' (fixed thresholds)")
    return flagging


def expected_for(row: SiteRow) -> dict[str, float] | None:
    """The format's error on Gaussian data of the row's block structure (None: nothing quantized
    or a point the baseline does not describe)."""
    if row.point not in EXPECTED_POINTS or row.format not in formats.names() or not row.shape:
        return None
    length = row.shape[0] if (row.kind == "conv1d" and row.point == "weight") else row.shape[-1]
    return expected_error(row.format, row.options, length=length)


def absolute(row: SiteRow, t: dict[str, float]) -> list[str]:
    """flagging="absolute": the fixed thresholds, the same for every format."""
    out = []
    for c in CHECKS:
        value = row.metrics[c.metric]
        limit = t[c.threshold]
        if c.worse(value, limit):
            sign = "<" if c.higher_is_better else ">"
            out.append(f"{c.label} {c.text(value)} {sign} {f'{100 * limit:g} %' if c.percent else f'{limit:g} dB'}")
    return out + nan_created(row)


NOISE_Z = 3.0  # a metric counts as worse only beyond this many standard errors of its estimate


def sampling_noise(metric: str, expected: float, n: float) -> float:
    """NOISE_Z standard errors of a metric estimated from n elements, so that tiny tensors (a
    router's [4, 64] weight, a [1, 64] shared-expert gate) are not flagged for a few unlucky values:
    a share p has standard error sqrt(p(1-p)/n); an SQNR, 10/ln 10 · sqrt(2/n) dB (a chi-square-like
    error energy). Negligible at the sizes of real layers (0.3 dB, 0.7 points at 4096 elements)."""
    if not n or n <= 0 or not math.isfinite(expected):
        return 0.0
    if metric == "sqnr_db":
        return NOISE_Z * 10 / math.log(10) * math.sqrt(2 / n)
    return NOISE_Z * math.sqrt(max(expected * (1 - expected), 0.0) / n)


def expected_limit(row: SiteRow, c: Check, t: dict[str, float]) -> float | None:
    """flagging="expected": the format's baseline for the row moved by the margin (at least the
    sampling noise of the row's element count); None without a baseline or margin."""
    expected = expected_for(row)
    if expected is None or c.margin is None:
        return None
    base = expected[c.metric]
    return c.limit(base, max(t[c.margin], sampling_noise(c.metric, base, row.metrics.get("n", 0))))


def against_expected(row: SiteRow, t: dict[str, float], outlier: str | None) -> list[str]:
    """flagging="expected": worse than the format does to Gaussian data of the same block
    structure by the margins, or a robust outlier among the model's sites; with the likely cause."""
    out = []
    expected = expected_for(row)
    if expected is not None:
        for c in CHECKS:
            limit = expected_limit(row, c, t)
            if limit is None:
                continue
            value, base = row.metrics[c.metric], expected[c.metric]
            if c.worse(value, limit):
                gap = (f"{base - value:.1f} dB below" if c.higher_is_better
                       else f"{100 * (value - base):.1f} points above")
                out.append(f"{c.label} {c.text(value)}, {gap} the {c.text(base)} {row.format} gives "
                           "Gaussian data of this block structure")
    if outlier:
        out.append(outlier)
    if out:
        out += _causes(row)
    return out + nan_created(row)


def _causes(row: SiteRow) -> list[str]:
    """The likely cause of a flagged weight, in words (from the scan's channel diagnostics and the
    weight's kurtosis)."""
    out = []
    d = row.diagnostics or {}
    channels = int(d.get("outlier_channels", 0) or 0)
    if channels:
        lost = d.get("outlier_block_deadzone", math.nan)
        tail = (f": blocks containing them lose {100 * lost:.0f} % of their other values to zero"
                if isinstance(lost, float) and math.isfinite(lost) else "")
        out.append(f"{channels} outlier input channel{'s' if channels > 1 else ''}{tail}")
    kurt = row.metrics.get("kurtosis_orig", math.nan)
    if row.point == "weight" and kurt > HEAVY_TAIL_KURTOSIS:
        out.append(f"heavy tails: kurtosis {kurt:.1f} (a Gaussian has 3), so a few large values "
                   "set each block's scale")
    return out


def robust_outliers(rows: list[SiteRow], t: dict[str, float]) -> dict[int, str]:
    """Rows whose SQNR is a robust outlier among the rows of the same point and format: more than
    `outlier_z` scaled MADs (1.4826·MAD, a Gaussian's std) and `outlier_min_db` below the median."""
    groups: dict[tuple[str, str], list[SiteRow]] = {}
    for r in rows:
        if math.isfinite(r.metrics["sqnr_db"]) and r.format != "none":
            groups.setdefault((r.point, r.format), []).append(r)
    out = {}
    for group in groups.values():
        if len(group) < 5:  # too few sites to say what is ordinary
            continue
        values = torch.tensor([r.metrics["sqnr_db"] for r in group], dtype=torch.float64)
        median = float(values.median())
        spread = 1.4826 * float((values - median).abs().median())
        for r in group:
            gap = median - r.metrics["sqnr_db"]
            least = max(t["outlier_min_db"], sampling_noise("sqnr_db", median, r.metrics.get("n", 0)))
            if gap > least and (spread == 0 or gap > t["outlier_z"] * spread):
                z = f"{gap / spread:.1f} robust deviations" if spread else "far"
                out[id(r)] = (f"SQNR {r.metrics['sqnr_db']:.2f} dB is {z} below the median "
                              f"{r.point} site of this model ({median:.2f} dB)")
    return out


def nan_created(row: SiteRow) -> list[str]:
    m = row.metrics
    if m["nan_quant"] > m["nan_orig"]:
        return [f"{int(m['nan_quant'] - m['nan_orig'])} NaN values created by quantization"]
    return []
