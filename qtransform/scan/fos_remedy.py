"""Four over six as the remedy for NVFP4 weights: measured beside plain NVFP4, chosen first.

NVFP4 maps each block's amax to 6, the top of E2M1, whose upper steps are coarse (4, 6): a block
whose values sit near 2/3 of its max loses them to the gap. Four over six (arXiv 2512.02010,
`four_over_six` on the nvfp4 format) quantizes every block twice, amax to 6 and to 4, and keeps
the candidate with the smaller error (squared: "mse", absolute: "mae"). The choice lives in the
E4M3 block scale, so the checkpoint is ordinary NVFP4: it costs no storage bit and nothing at
inference for a weight, only quantization time (each block quantized twice, once per weight
version). Transformer Engine, FlashInfer and ModelOpt compute it, and vLLM's `nvfp4_4over6` KV
cache for keys and values (docs/recipes.md "Four over six: whose order").

A weight scan of a plain NVFP4 rule (default order, 1D blocks) measures it on every weight
(`scan_weights(four_over_six=("mse",))`, the default) into the row's `remedies`: label
"four_over_six=MODE" -> {"metrics", "state", "kind": "four_over_six", "fields" (what the
quantize rule gains), "rule" (the index of the rule that quantizes the weight in the report's
`meta.quantize`), "max4_blocks", "blocks", "max4_share" (the blocks that kept max/4,
`formats.quantize.four_over_six_blocks`)}.

Cost model (what `recommend` weighs): cheaper than a rotation (an online transform of the
activations) and than higher precision (bits). A rule gains `four_over_six` when, with it on
every weight of the rule, the report's own flagging rule (`ScanReport.row_problems`, the
thresholds `problems()` uses, judged against the scanned format's baseline) clears flagged rows
of it; what is still flagged then gets the other remedies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from qtransform.formats import QuantConfig

if TYPE_CHECKING:
    from qtransform.scan.report import ScanReport, SiteRow

KIND = "four_over_six"
MODES = ("mse",)  # what a weight scan measures by default ("mae" on request)
ENGINES = ("Transformer Engine (NVFP4BlockScaling, nvfp4_4over6), FlashInfer (NVFP44Over6Config), "
           "ModelOpt (NVFP4_FOUR_OVER_SIX_CFG, a calibrated variant), vLLM's nvfp4_4over6 KV cache "
           "(keys and values)")


def label(mode: str) -> str:
    return f"{KIND}={mode}"


def alternative(cfg: QuantConfig, mode: str) -> QuantConfig | None:
    """`cfg` with four over six `mode` where it is plain NVFP4 that takes the option (the default
    order, 1D blocks: the family's own check decides); None elsewhere."""
    if cfg.name != "nvfp4" or cfg.four_over_six != "none":
        return None
    try:
        return QuantConfig.from_options(cfg.name, {**cfg.options(), "four_over_six": mode})
    except ValueError:
        return None


def entry(stats: Any, mode: str, rule: int, max4: tuple[int, int]) -> dict[str, Any]:
    """A row's `remedies` entry for four over six `mode` (`stats`: its ErrorStats)."""
    chosen, blocks = max4
    return {"metrics": stats.result(), "state": stats.state(), "kind": KIND,
            "fields": {"four_over_six": mode}, "rule": rule, "max4_blocks": chosen,
            "blocks": blocks, "max4_share": chosen / blocks if blocks else 0.0}


def is_entry(found: dict[str, Any]) -> bool:
    """A four-over-six entry of `remedies` (the others: rotations, KV scales)."""
    return found.get("kind") == KIND


def labels(report: ScanReport) -> list[str]:
    """The four-over-six labels the report measured, in the order measured."""
    seen = (k for r in report.rows for k, e in (r.remedies or {}).items() if is_entry(e))
    return list(dict.fromkeys(seen))


def remedied(row: SiteRow, key: str) -> SiteRow:
    """The row as it reads measured with four over six `key`."""
    found = (row.remedies or {})[key]
    return replace(row, metrics=dict(found["metrics"]), state=dict(found["state"]), remedies=None,
                   diagnostics=None, experts=None)


def applied(report: ScanReport, key: str, rules: set[int]) -> ScanReport:
    """The report with four over six `key` on every weight of `rules` that measured it."""
    rows = [remedied(r, key) if key in (r.remedies or {}) and r.remedies[key]["rule"] in rules else r
            for r in report.rows]
    return replace(report, rows=rows, _cache=None)


@dataclass
class FosChoice:
    """The four-over-six mode that clears flagged rows (`label`, `mode`), the rules that gain it,
    the rows it clears (site, SQNR before, after, share of max/4 blocks) and the report with it
    applied (what the other remedies then judge)."""

    label: str
    mode: str
    rules: list[int]
    cleared: list[tuple[str, float, float, float]] = field(default_factory=list)
    report: ScanReport | None = None


def choose(report: ScanReport) -> FosChoice | None:
    """The measured mode that clears the most flagged rows (the first measured on a tie), on
    the rules of those rows; None when none clears any."""
    best: FosChoice | None = None
    for key in labels(report):
        flagged = [r for r, _ in report.problems() if key in (r.remedies or {})]
        rules = {r.remedies[key]["rule"] for r in flagged}
        trial = applied(report, key, rules)
        still = {r.label for r, _ in trial.problems()}
        cleared = [r for r in flagged if r.label not in still]
        rules = {r.remedies[key]["rule"] for r in cleared}  # a rule with nothing cleared stays
        if cleared and (best is None or len(cleared) > len(best.cleared)):
            best = FosChoice(key, key.split("=", 1)[1], sorted(rules),
                             [(r.site, r.metrics["sqnr_db"], r.remedies[key]["metrics"]["sqnr_db"],
                               r.remedies[key]["max4_share"]) for r in cleared],
                             applied(report, key, rules))
    return best


def cost_text() -> str:
    """What four over six costs and which engines compute it, in words."""
    return ("no storage bit (the choice lives in the E4M3 block scales: the checkpoint is ordinary "
            "NVFP4) and nothing at inference for a weight; it costs quantization time (each block "
            f"quantized twice). Engines that compute it: {ENGINES}")
