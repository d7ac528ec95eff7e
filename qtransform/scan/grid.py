"""Weights that already sit on a coarse grid: which known scheme made them.

A dequantized GGUF (SmolLM2-135M's Q4_1: 16 affine levels per 32-block) or a decompressed
compressed-tensors model looks like any other weight to a scan, yet quantizing it again stacks a
second rounding on the first (the perplexity of SmolLM2 went from 26.3 to 44.8 that way, unsaid).
`grid_fit` tells such weights apart from trained ones: per block of the reduction axis it counts
the distinct values, and checks whether every block is exactly (to the storage dtype's rounding)
a scale times the levels of one scheme:

- E2M1 per 32 with a power-of-two scale: MXFP4; E2M1 per 16 with any scale: NVFP4;
- symmetric integers d*k, |k| <= 2^(bits-1), per channel or group (int4, GGUF Q4_0, int8,
  GGUF Q8_0): groups tried coarsest first, since a coarse group's data fits every finer one;
- affine d*k + m, k in 0..15 per 32 (GGUF Q4_1, asymmetric int4);
- FP8 E4M3 per channel or per tensor (scale amax/448).

Trained weights in bf16 have as many distinct values per block as elements, and fit none of
these: a Gaussian tensor is never reported (tests/scan/test_grid.py checks both ways).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qtransform.formats.registry import E2M1, E4M3

TOLERANCE = 2.0**-7  # relative: a code times its scale rounded once to bf16, the scale from amax
MIN_ELEMENTS = 256  # fewer elements say nothing about a grid
SAMPLE_ROWS = 8  # rows every check tries first
LEVEL_ROWS = 64  # rows the distinct levels are counted on
CONFIRM_ROWS = 256  # rows spread over the tensor that must fit too
E2M1_MAGNITUDES = E2M1.grid()
E4M3_MAGNITUDES = E4M3.grid()
E2M1_TOPS = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)  # which code a block's amax may be


@dataclass(frozen=True)
class GridFit:
    """The scheme a weight's values fit exactly, and the median distinct values per 32-block."""

    scheme: str
    levels: int

    def to_dict(self) -> dict[str, object]:
        return {"scheme": self.scheme, "levels": self.levels}


def _blocks(w: Tensor, size: int | None) -> Tensor | None:
    """[n, size] blocks of the last axis (None when it does not divide); size None = rows."""
    cols = w.shape[-1]
    if size is None:
        return w.reshape(-1, cols)
    if cols % size:
        return None
    return w.reshape(-1, size)


def _on_magnitudes(r: Tensor, magnitudes: Tensor) -> Tensor:
    """Per row: every |r| within TOLERANCE (relative) of one of `magnitudes` (sorted, from 0)."""
    a = r.abs()
    idx = torch.bucketize(a, magnitudes).clamp(1, len(magnitudes) - 1)
    near = torch.minimum((a - magnitudes[idx - 1]).abs(), (magnitudes[idx] - a).abs())
    inside = a <= magnitudes[-1] * (1 + TOLERANCE)
    return ((near <= TOLERANCE * a.clamp_min(magnitudes[1])) & inside).all(dim=-1)


def _e2m1(blocks: Tensor, pow2: bool) -> bool:
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    live = amax.squeeze(-1) > 0
    if not live.any():
        return False
    blocks, amax = blocks[live], amax[live]
    fits = torch.zeros(len(blocks), dtype=torch.bool)
    for top in E2M1_TOPS:
        scale = amax / top
        if pow2:  # MX: the scale is a power of two, amax/top must be one
            mant, _ = torch.frexp(scale)
            ok_scale = (mant - 0.5).abs().squeeze(-1) <= TOLERANCE
        else:
            ok_scale = torch.ones(len(blocks), dtype=torch.bool)
        fits |= ok_scale & _on_magnitudes(blocks / scale, E2M1_MAGNITUDES)
        if fits.all():
            return True
    return bool(fits.all())


def _integers(blocks: Tensor, bits: int, affine: bool) -> bool:
    """Every block is d*k (|k| <= 2^(bits-1)) or, `affine`, d*k + m with k in 0..2^bits-1.

    The step d is guessed per block from its smallest gap between distinct values and from
    its amax over the largest codes (restricted qmax, or compressed-tensors' full range)."""
    qmax = 2 ** (bits - 1)
    values = blocks.sort(dim=-1).values
    low = values[:, :1] if affine else torch.zeros_like(values[:, :1])
    shifted = values - low
    top = shifted.abs().amax(dim=-1, keepdim=True)
    gaps = torch.cat([shifted.diff(dim=-1), shifted.abs()], dim=-1)
    smallest = torch.where(gaps > TOLERANCE * top, gaps, torch.full_like(gaps, float("inf")))
    candidates = [smallest.amin(dim=-1, keepdim=True)]
    candidates += [top / (2 * qmax - 1)] if affine else [top / (qmax - 1), top / qmax]
    live = (top > 0).squeeze(-1)
    if not live.any():
        return False
    fits = torch.zeros(int(live.sum()), dtype=torch.bool)
    for step in candidates:
        k = shifted[live] / step[live]
        whole = ((k - k.round()).abs() <= TOLERANCE * k.abs() + 1e-3).all(dim=-1)
        span = k.round().abs().amax(dim=-1) <= (2 * qmax - 1 if affine else qmax)
        fits |= whole & span & torch.isfinite(step[live]).squeeze(-1)
    return bool(fits.all())


def _fp8(blocks: Tensor, amax: Tensor | None = None) -> bool:
    """Every block is E4M3 values times amax/448 (`amax`: the tensor's, else each block's)."""
    amax = blocks.abs().amax(dim=-1, keepdim=True) if amax is None else amax.expand(len(blocks), 1)
    live = amax.squeeze(-1) > 0
    return bool(live.any()) and bool(_on_magnitudes(blocks[live] / (amax[live] / 448.0),
                                                    E4M3_MAGNITUDES).all())


def distinct_levels(w: Tensor, block: int = 32) -> int:
    """The median number of distinct values per block of `block` elements of the last axis."""
    blocks = _blocks(w.detach().float(), block)
    if blocks is None:
        blocks = w.detach().float().reshape(1, -1)
    values = blocks.sort(dim=-1).values
    counts = 1 + (values.diff(dim=-1) != 0).sum(dim=-1)
    return int(counts.median().item())


def grid_fit(w: Tensor) -> GridFit | None:
    """The coarse grid `w` (a weight, reduction axis last) already sits on, or None; `levels`
    is the median distinct values per 32-block of its first rows.

    Checked in order, the most specific scheme first; the first that every block of the first
    rows and of up to CONFIRM_ROWS rows spread over the tensor fits wins (a sample: the answer
    names a grid, it does not prove every element sits on it)."""
    if w.ndim < 2 or w.numel() < MIN_ELEMENTS or not w.is_floating_point():
        return None
    rows = w.detach().reshape(-1, w.shape[-1])
    sample = rows[:SAMPLE_ROWS].float()
    if not torch.isfinite(sample).all():
        return None
    levels = distinct_levels(rows[:LEVEL_ROWS].float())
    spread = rows[torch.linspace(0, len(rows) - 1, min(len(rows), CONFIRM_ROWS)).long()].float()
    amax = w.detach().abs().amax().float().reshape(1, 1)
    checks = []
    if levels <= 30:  # 4-bit grids: at most 15 levels per 16-block, 16 per 32-block
        checks += [
            ("mxfp4 (E2M1, power-of-two scale per 32)", lambda r: _e2m1_at(r, 32, True)),
            ("nvfp4 (E2M1 per 16)", lambda r: _e2m1_at(r, 16, False)),
            *[(f"int4 {_group_words(g)}" + (" (GGUF Q4_0)" if g == 32 else ""),
               lambda r, g=g: _ints_at(r, g, 4, False)) for g in (None, 128, 64, 32)],
            ("GGUF Q4_1 (16 affine levels per 32)", lambda r: _ints_at(r, 32, 4, True)),
        ]
    checks += [
        *[(f"int8 {_group_words(g)}" + (" (GGUF Q8_0)" if g == 32 else ""),
           lambda r, g=g: _ints_at(r, g, 8, False)) for g in (None, 128, 32)],
        ("fp8 e4m3 per tensor", lambda r: _fp8(r, amax)),
        ("fp8 e4m3 per channel", lambda r: _fp8(r)),
    ]
    for name, fits in checks:  # a few rows first (trained weights fail there), then rows spread
        if fits(sample) and (len(rows) <= SAMPLE_ROWS or fits(spread)):
            return GridFit(name, levels)
    return None


def _group_words(group: int | None) -> str:
    return "per channel" if group is None else f"groups of {group}"


def _e2m1_at(x: Tensor, size: int, pow2: bool) -> bool:
    blocks = _blocks(x, size)
    return blocks is not None and _e2m1(blocks, pow2)


def _ints_at(x: Tensor, size: int | None, bits: int, affine: bool) -> bool:
    blocks = _blocks(x, size)
    if blocks is None or (size is None and x.shape[-1] > 8192):
        return False
    return _integers(blocks, bits, affine)


def grid_line(fits: dict[str, dict[str, object]]) -> str | None:
    """The report line for weights found on a grid (None when there are none)."""
    if not fits:
        return None
    schemes: dict[str, int] = {}
    for fit in fits.values():
        schemes[str(fit["scheme"])] = schemes.get(str(fit["scheme"]), 0) + 1
    parts = [f"weights of {n} site{'s' if n != 1 else ''} already on {'a' if s.startswith('GGUF') else 'an'} "
             f"{s} grid"
             for s, n in sorted(schemes.items(), key=lambda kv: -kv[1])]
    return "; ".join(parts) + ": re-quantizing stacks two roundings"
