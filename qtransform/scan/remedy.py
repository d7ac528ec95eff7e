"""A rotation as the remedy for a site a format hurts: measured, then weighed against bits.

The remedy researchers try first when a 4-bit format hurts is a blockwise Hadamard rotation of
the reduction axis (x -> x·R, W -> W·R; the `rotate` policy section): an outlier input channel
is spread over its block before the block scale sees it. A weight scan measures it directly:
the error of the format on W·R (`formats.hadamard.fwht`, the same rotation the pass applies).
Because R is orthogonal, SQNR and MSE of W·R against its quantization equal those of W against
the effective weight Q(W·R)·Rᵀ, so the two numbers compare as they are.

Cost model (what `recommend` weighs): a rotation costs no storage bit; it costs an online
transform of the site's activations, log2(b) additions per input element (the weight is rotated
once, offline). Higher precision costs bits: every weight of the site moves from the format's
effective bits to the finer format's (or to 16 when kept unquantized). A rotation that heals a
site (the report's own flagging rule finds no problem in the rotated row) is therefore the
cheaper remedy, and is proposed for exactly the sites it heals; the others keep the usual
remedies.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from qtransform.core.sites import ATTENTION_KIND
from qtransform.errors import UserError
from qtransform.formats import hadamard

if TYPE_CHECKING:
    from qtransform.scan.report import ScanReport, SiteRow

ENERGY = ("sqnr_db", "rel_rmse")  # the error-energy checks a rotated weight must always meet

KINDS = ("hadamard", "random_hadamard")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)(?:-(?P<block>\d+|axis))?(?::(?P<seed>\d+))?$")


@dataclass(frozen=True)
class Rotation:
    """One rotation to try: `kind` and `block_size` (None: the whole axis) as in a `rotate` rule."""

    kind: str = "hadamard"
    block_size: int | None = 32
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> Rotation:
        """'hadamard-32', 'random_hadamard-64:7' (seed 7), 'hadamard' or 'hadamard-axis' (the
        whole axis)."""
        found = _SPEC.match(text.strip())
        block = int(found["block"]) if found and found["block"] not in (None, "axis") else None
        if (found is None or found["kind"] not in KINDS or (block is not None and not hadamard.is_power_of_two(block))
                or (found["seed"] and found["kind"] != "random_hadamard")):
            raise UserError(f"rotation {text!r}: write KIND-BLOCK with KIND one of {', '.join(KINDS)} "
                            "and BLOCK a power of two (e.g. hadamard-32, random_hadamard-64:7 for "
                            "seed 7; no BLOCK rotates the whole axis)")
        return cls(found["kind"], block, int(found["seed"] or 0))

    @property
    def label(self) -> str:
        seed = f":{self.seed}" if self.kind == "random_hadamard" and self.seed else ""
        return f"{self.kind}-{self.block_size or 'axis'}{seed}"

    def block_for(self, length: int) -> int | None:
        """The block this rotation uses on an axis of `length`; None where it cannot apply."""
        b = self.block_size or length
        return b if hadamard.is_power_of_two(b) and length % b == 0 else None

    def apply(self, w: torch.Tensor, axis: int) -> torch.Tensor | None:
        """w rotated along `axis` (W·R for a weight's reduction axis); None where it cannot."""
        b = self.block_for(w.shape[axis])
        if b is None:
            return None
        signs = hadamard.random_signs(b, self.seed) if self.kind == "random_hadamard" else None
        return hadamard.fwht(w.movedim(axis, -1), b, signs).movedim(-1, axis)

    def rule(self, sites: list[str]) -> dict[str, Any]:
        """The `rotate` policy rule that applies this rotation to `sites`."""
        rule: dict[str, Any] = {"name": f"remedy {self.label}", "targets": list(sites),
                                "kind": self.kind, "block_size": self.block_size}
        if self.kind == "random_hadamard":
            rule["seed"] = self.seed
        return rule

    def online_adds(self, length: int) -> int:
        """Additions per input element of the online transform (its only cost)."""
        b = self.block_for(length) or 1
        return int(math.log2(b))


def rotated_row(row: SiteRow, label: str) -> SiteRow | None:
    """The SiteRow as it would read with the rotation `label` measured on it (None: not measured)."""
    found = (row.remedies or {}).get(label)
    if not found:
        return None
    return replace(row, metrics=dict(found["metrics"]), state=dict(found["state"]), diagnostics=None,
                   remedies=None, experts=None)


def heals(report: ScanReport, row: SiteRow, rotated: SiteRow) -> bool:
    """Whether the rotated row heals a flagged row under the report's flagging rule. A rotation
    flattens the blocks it spreads an outlier over, which moves their deadzone and saturation
    (measures of block shape, whose error SQNR already counts): so the rotated weight must meet
    the limits of the error-energy metrics (SQNR, rel_rmse) and of every metric the site was
    flagged for, and gain SQNR; a site flagged only as an outlier among the model's sites must
    come up to their median SQNR."""
    if not rotated.metrics["sqnr_db"] > row.metrics["sqnr_db"]:
        return False
    was_bad = report.over_limits(row)
    if report.over_limits(rotated) & (was_bad | set(ENERGY)):
        return False
    if was_bad:
        return True
    peers = [r.metrics["sqnr_db"] for r in report.rows if r.point == row.point and r.format == row.format]
    return rotated.metrics["sqnr_db"] >= statistics.median(peers)


def healed_sites(report: ScanReport) -> tuple[str | None, list[str], ScanReport]:
    """(the rotation's label, the flagged sites it heals (`heals`), the report without them:
    what is left for the other remedies); (None, [], report) when it measured no rotation
    (an attention row's remedies are KV scales, `scan/kv_remedy.py`, and an entry with a "kind"
    another remedy, such as four over six, `scan/fos_remedy.py`)."""
    labels = sorted({k for r in report.rows if r.kind != ATTENTION_KIND
                     for k, found in (r.remedies or {}).items() if "kind" not in found})
    if not labels:
        return None, [], report
    label = labels[0]
    healed = []
    for row in report.rows:
        rotated = rotated_row(row, label) if report.row_problems(row) else None
        if rotated is not None and heals(report, row, rotated):
            healed.append(row.site)
    rest = [r for r in report.rows if r.site not in set(healed)]
    return label, healed, replace(report, rows=rest, _cache=None)
