"""Per-site weight and error histograms for the scan pages: what the weights look like and how
the format's error is spread over them, which a report's summary numbers cannot show.

A scan report keeps sums, not tensors, so the histograms are recomputed from the scanned source
(a module or a checkpoint): each weight is quantized once more exactly as the scan did (same
format, options, block axis and stochastic-rounding seed, and the same tensor: W·R where the
report's rotate rules rotate it, with its scale group's amax, `scan.seen`), and an evenly strided
sample of at most `SAMPLE` values of that weight and of its error is binned. That is one more pass of
the scan's own cost, so it runs only up to `MAX_ELEMENTS` weight elements in all (the tiny and
demo models; docs/reports.md); above, the pages show the block-exponent spread alone.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from qtransform.formats.quantize import quantize_with_info
from qtransform.passes.fake_quant import first_weight_seed
from qtransform.scan.report import ScanReport
from qtransform.scan.seen import SeenWeights
from qtransform.scan.sources import weight_refs
from qtransform.scan.weights import config_for

if TYPE_CHECKING:
    import os

    from torch import nn

MAX_ELEMENTS = 50_000_000
BINS = 40
SAMPLE = 2**18  # values binned per site: an evenly strided sample keeps the shape, not the cost


def _hist(x: torch.Tensor, bins: int) -> dict[str, list[float]]:
    """Counts over `bins` equal bins between the finite minimum and maximum: {"edges", "counts"}."""
    x = x.detach().reshape(-1)
    x = x[:: max(1, x.numel() // SAMPLE)].to(torch.float32)
    if x.numel() == 0:
        return {"edges": [], "counts": []}
    lo, hi = (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(lo) and math.isfinite(hi)):  # rare: pay for the mask only then
        x = x[torch.isfinite(x)]
        if x.numel() == 0:
            return {"edges": [], "counts": []}
        lo, hi = (float(v) for v in torch.aminmax(x))
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(x, bins=bins, min=lo, max=hi)
    step = (hi - lo) / bins
    return {"edges": [lo + i * step for i in range(bins + 1)], "counts": [int(c) for c in counts.tolist()]}


def site_histograms(source: nn.Module | str | os.PathLike[str], report: ScanReport, *, bins: int = BINS,
                    max_elements: int = MAX_ELEMENTS) -> dict[str, dict[str, Any]]:
    """{site: {"weight": hist, "error": hist}} for the report's 2-D weight rows; {} when the
    source holds more than `max_elements` scanned weight elements (or none)."""
    rows = {r.site: r for r in report.rows if r.point == "weight" and len(r.shape) == 2}
    if not rows or sum(math.prod(r.shape) for r in rows.values()) > max_elements:
        return {}
    refs = [ref for ref in weight_refs(source) if ref.site.name in rows]
    seen = SeenWeights.of(refs, report.meta.get("rotate"), report.meta.get("scale_groups") or ())
    out = {}
    for ref in refs:
        name = ref.site.name
        row = rows[name]
        cfg = config_for(row.format, row.options).bind(ref.site.reduction_axis)
        w = seen.tensor(name)
        xq, _, _ = quantize_with_info(w, cfg, seed=first_weight_seed(cfg, name, None), amax=seen.amax(name))
        out[row.site] = {"weight": _hist(w, bins), "error": _hist(xq.float() - w.float(), bins)}
    return out
