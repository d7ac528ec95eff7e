"""What a format does to well-behaved data: the baseline that scans flag sites against.

A 4-bit block format loses about 18.8 dB SQNR on Gaussian weights whatever the model, so an
absolute SQNR limit of 20 dB flags every MXFP4 site and says nothing about which ones are in
trouble. `expected_error` measures the format on i.i.d. standard-normal data of the site's block
structure (its reduction length, hence the padding of a partial last block and, for NVFP4, the
per-tensor scale) by Monte Carlo with a fixed seed, once per (format, options, length): a site
is worse than its format only when it is worse than this.

Definitions match `qtransform.core.metrics` (float64 sums): SQNR `10·log10(Σx²/Σe²)`, deadzone the
share of nonzero inputs quantized to zero, saturation the share the format's mask marks.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from qtransform.formats.options import NUMERICS_OPTIONS, WHOLE_ROW, QuantConfig
from qtransform.formats.quantize import quantize_with_info
from qtransform.formats.registry import get

SEED = 0
MIN_ELEMENTS = 1 << 16  # Monte Carlo size: the SQNR estimate is good to about 0.02 dB
MIN_ROWS = 16
BLOCK_SCALE_BITS = {"e8m0": 8, "e4m3_fp32": 8, "fp32": 32, "fp32_tensor": 0}  # by `FormatSpec.scale`
TENSOR_SCALE_BITS = 32  # the fp32 scale of a family that needs the tensor's amax (`Family.per_tensor`)


def expected_error(fmt: str, options: dict[str, Any] | None = None, *, length: int) -> dict[str, float]:
    """SQNR (dB), deadzone, saturation and rel_rmse of `fmt` on i.i.d. N(0, 1) rows of `length`
    elements, quantized along the row (the reduction axis), with the value-changing `options`."""
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (options or {}).items()
            if k in NUMERICS_OPTIONS and k != "axis" and v is not None}
    return dict(_expected(get(fmt).name, tuple(sorted(opts.items())), max(1, int(length))))


@lru_cache(maxsize=512)
def _expected(fmt: str, options: tuple[tuple[str, Any], ...], length: int) -> tuple[tuple[str, float], ...]:
    rows = max(MIN_ROWS, math.ceil(MIN_ELEMENTS / length))
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(rows, length, generator=gen, dtype=torch.float32)
    opts = dict(options)
    xq, sat, _ = quantize_with_info(x, fmt, axis=-1, seed=SEED if opts.get("rounding") == "stochastic" else None,
                                    **opts)
    xd, qd = x.double(), xq.double()
    e2 = float(((xd - qd) ** 2).sum())
    s2 = float((xd**2).sum())
    n = x.numel()
    std = float(xd.std(unbiased=False))
    return (
        ("sqnr_db", 10 * math.log10(s2 / e2) if e2 > 0 else math.inf),
        ("deadzone", float(((xq == 0) & (x != 0)).sum()) / float((x != 0).sum())),
        ("saturation", float(sat.sum()) / n),
        ("rel_rmse", math.sqrt(e2 / n) / std),
    )


def effective_bits(fmt: str, options: dict[str, Any] | None = None, *, numel: int | None = None) -> float:
    """Storage bits per element: the element code, its share of its block's scale, and its share
    of the tensor's fp32 scale when the format has one, spread over the `numel` elements of the
    tensor (left out when `numel` is None). MXFP4: 4 + 8/32 = 4.25; NVFP4 on a 4096-element
    tensor: 4 + 8/16 + 32/4096; an FP8 format with one scale per tensor: 8 + 32/numel. A scale
    per channel or per token is one per row, whose length is not known here: its share (32 over
    the row length) is left out."""
    opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (options or {}).items()
            if k in NUMERICS_OPTIONS and k != "axis" and v is not None}
    cfg = QuantConfig.from_options(fmt, opts)
    bits = float(cfg.spec.element.bits)
    if cfg.granularity not in WHOLE_ROW:
        bits += BLOCK_SCALE_BITS[cfg.spec.scale] / (math.prod(cfg.tile) if cfg.tile else cfg.block)
    if numel and cfg.family.per_tensor(cfg):
        bits += TENSOR_SCALE_BITS / numel
    return bits
