"""Budgeted mixed precision: which sites to keep in high precision within a budget.

From a `SensitivityReport` (an additive model: a policy's end-to-end effect is predicted as the
sum of its quantized sites' one-at-a-time sensitivities), `budget_policy` chooses the kept sites
under one budget (`keep`, `share`, `bits` or `target`); `measured_budget` then runs that policy
end to end, so the prediction is checked by a measurement; `budget_guide` does both for a scan
report's quantize rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from qtransform.calibration import Calibration
from qtransform.errors import UserError
from qtransform.formats.expected import effective_bits
from qtransform.scan.recommend import HIGH_PRECISION_BITS, ignoring, validated
from qtransform.scan.report import ScanReport
from qtransform.scan.sensitivity import measure_policy, site_sensitivity
from qtransform.scan.sensitivity_report import SensitivityReport
from qtransform.scan.setup import CalibrationSpec
from qtransform.schemas.base import ATTENTION_TENSORS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_KNAPSACK_CELLS = 20_000_000


@dataclass
class Budgeted:
    """The policy that keeps the most sensitive sites in high precision within a budget."""

    policy: dict[str, Any]
    kept_sites: list[str]
    method: str  # top-k | knapsack (exact 0/1) | greedy
    budget: dict[str, float]
    effective_bits: float  # mean storage bits per weight of the selected sites under the policy
    predicted: float  # sum of the quantized sites' one-at-a-time sensitivities
    measured: float | None = None  # the whole policy run end to end (`measure_policy`)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def budget_policy(report: SensitivityReport, *, bits: float | None = None, keep: int | None = None,
                  share: float | None = None, target: float | None = None) -> Budgeted:
    """Choose the sites to keep in high precision under exactly one budget, from a
    `SensitivityReport` (additive model: the end-to-end effect of a policy is predicted as the sum
    of its quantized sites' one-at-a-time sensitivities).

    - `keep` sites / `share` of the sites: the most sensitive ones (optimal under the model);
    - `bits`: mean effective bits per weight at most `bits`; an exact 0/1 knapsack over parameter
      counts (in units of their gcd) maximizes the kept sensitivity, greedy by sensitivity per
      parameter when the table would exceed `MAX_KNAPSACK_CELLS`;
    - `target`: predicted sensitivity at most `target`, keeping sites greedily by sensitivity per
      parameter (fewest parameters kept first).
    """
    given = {k: v for k, v in (("bits", bits), ("keep", keep), ("share", share), ("target", target))
             if v is not None}
    if len(given) != 1:
        raise UserError("give exactly one budget: bits, keep, share or target")
    rows = list(report.rows)
    score = {r.site: max(r.score(), 0.0) if not math.isnan(r.score()) else 0.0 for r in rows}
    qbits = {r.site: effective_bits(r.format, r.options, numel=r.params) for r in rows}
    params = {r.site: max(int(r.params), 1) for r in rows}
    by_score = sorted(rows, key=lambda r: (-score[r.site], r.site))
    if keep is not None or share is not None:
        n = int(keep) if keep is not None else math.floor(float(share) * len(rows) + 1e-9)
        if not 0 <= n <= len(rows):
            raise UserError(f"keep {n} sites: the report has {len(rows)}")
        kept, method = [r.site for r in by_score[:n]], "top-k"
    elif bits is not None:
        kept, method = _knapsack(rows, score, qbits, params, float(bits))
    else:
        kept, rest = [], sum(score.values())
        for r in sorted(rows, key=lambda r: (-score[r.site] / params[r.site], r.site)):
            if rest <= float(target):
                break
            kept.append(r.site)
            rest -= score[r.site]
        method = "greedy"
    total = sum(params.values())
    eff = sum(params[s] * (HIGH_PRECISION_BITS if s in kept else qbits[s]) for s in params) / total
    predicted = sum(v for s, v in score.items() if s not in set(kept))
    rules = [dict(r) for r in report.meta["quantize"]]
    attention = {r.site for r in report.rows if set(r.points) & set(ATTENTION_TENSORS)}
    policy = validated({"version": 1, "quantize": ignoring(rules, kept, attention)})
    return Budgeted(policy, kept, method, given, eff, predicted)


def _knapsack(rows: list[Any], score: dict[str, float], qbits: dict[str, float],
              params: dict[str, int], bits: float) -> tuple[list[str], str]:
    """Keep a set of sites maximizing their summed sensitivity with mean bits <= `bits`."""
    total = sum(params.values())
    base = sum(params[s] * qbits[s] for s in params)
    capacity_bits = bits * total - base
    if capacity_bits < -1e-9 * total:
        raise UserError(f"{bits:g} bits per weight is below what quantizing every site gives "
                         f"({base / total:.3f})")
    cost = {s: params[s] * (HIGH_PRECISION_BITS - qbits[s]) for s in params}
    unit = math.gcd(*params.values())
    per = {s: cost[s] / unit for s in cost}
    cap = capacity_bits / unit
    # integer costs: every site of one format costs params * (16 - b) / unit, a multiple of the
    # (rational) bit gap; scale by 4 so the quarter-bit gaps of MX/NVFP4 are integers
    weight = {s: round(4 * per[s]) for s in per}
    slots = math.floor(4 * cap + 1e-6)
    if slots * len(rows) <= MAX_KNAPSACK_CELLS and all(abs(weight[s] - 4 * per[s]) < 1e-6 for s in per):
        best = [0.0] * (slots + 1)
        take: list[list[bool]] = []
        names = [r.site for r in rows]
        for s in names:
            row = [False] * (slots + 1)
            w, v = weight[s], score[s]
            for c in range(slots, w - 1, -1):
                if best[c - w] + v > best[c]:
                    best[c], row[c] = best[c - w] + v, True
            take.append(row)
        kept, c = [], slots
        for i in range(len(names) - 1, -1, -1):
            if take[i][c]:
                kept.append(names[i])
                c -= weight[names[i]]
        return sorted(kept, key=names.index), "knapsack"
    kept, used = [], 0.0
    for r in sorted(rows, key=lambda r: (-score[r.site] / cost[r.site], r.site)):
        if used + cost[r.site] <= capacity_bits:
            kept.append(r.site)
            used += cost[r.site]
    return kept, "greedy"


def measured_budget(sensitivity: SensitivityReport, budget: dict[str, float], model: nn.Module,
                    calib: Calibration | CalibrationSpec, *, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8,
                    max_length: int = 128) -> Budgeted:
    """`budget_policy` under one budget (`bits`, `keep`, `share` or `target`), its policy then run
    end to end on `model` (`measure_policy`), so the prediction is checked by a measurement."""
    result = budget_policy(sensitivity, **budget)
    result.measured = measure_policy(model, result.policy, calib, tokenizer=tokenizer,
                                     batch_size=batch_size, max_length=max_length)
    return result


def budget_guide(report: ScanReport, budget: dict[str, float], model: nn.Module, calib: Calibration | CalibrationSpec, *,
                 sensitivity: SensitivityReport | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 batch_size: int = 8, max_length: int = 128,
                 progress: bool | None = False) -> tuple[Budgeted, SensitivityReport]:
    """A scan report's budgeted mixed precision: the policy that keeps the most sensitive of its
    sites in high precision within `budget`, predicted and measured on `model` (`measured_budget`).

    The ranking is `sensitivity` (a report of the same format) or, without one, the exact
    sensitivity of the report's quantize rules, computed here (one run of `calib` per site).
    Returns the budgeted policy and the ranking it read.
    """
    rules = report.meta.get("quantize")
    if not rules:
        raise UserError("the scan report names no quantize rules; re-run `qtransform scan`")
    if sensitivity is not None:
        formats = (sensitivity.meta.get("format"), report.meta.get("format"))
        if "mixed" not in formats and formats[0] != formats[1]:
            raise UserError(f"the sensitivity report ranks {formats[0]} sites but the scan report "
                            f"scanned {formats[1]}: give reports of the same format")
    kw = {"tokenizer": tokenizer, "batch_size": batch_size, "max_length": max_length}
    if sensitivity is None:
        sensitivity = site_sensitivity(model, {"version": 1, "quantize": rules}, calib,
                                       progress=progress, **kw)
    return measured_budget(sensitivity, budget, model, calib, **kw), sensitivity
