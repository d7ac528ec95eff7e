"""Quartet II's EDEN-corrected NVFP4 quantizer (arXiv 2601.22813): an unbiased estimate of a
Hadamard-rotated backward operand in NVFP4, without stochastic rounding of the elements.

Round-to-nearest is biased; for a vector rotated by a random Hadamard, EDEN's correction makes
it unbiased (in expectation over the rotation's signs) by rescaling each Hadamard group's
dequantized values by S = <y, y> / <y, q> (y the scaled values, q their E2M1 roundings). The
corrected block scales are no longer E4M3 numbers, so they are rounded to E4M3 stochastically
(unbiased). The tensor scale maps the amax to `scale_max` (255.99, not 448, leaving the
correction room to scale up) and a block's amax to `block_max` (6 / ((17/16)·0.93): the elements
use a little less than E2M1's range). The order of fp32 operations is the reference's (Quartet II
`src/models/quantization/schemes/quartet_2.py`, `eden_1x16s_fp4_kernel`):

    s_dec = amax / scale_max / block_max        (1 if amax == 0; amax over the whole operand)
    s_b   = e4m3_rne((amax_b / block_max) / s_dec)   (1 where it is 0)
    y     = x / (s_b · s_dec)
    q     = E2M1(y), nearest, ties away from zero (|y| >= 5 -> 6, >= 3.5 -> 4, ...)
    S     = sum(y·y) / sum(y·q) over each group of `group` elements (1 where sum(y·q) == 0)
    c     = s_b · S;  s = the E4M3 neighbour of c above it with probability (c - down)/(up - down)
    out   = q · s · s_dec

The uniform of block scale k (its row-major index among the operand's block scales) is
`philox.uniform_at(seed, k)`, or the `u` passed in (tests inject a reference's draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qtransform.formats import philox
from qtransform.formats.elements import round_signed
from qtransform.formats.nvfp4 import e4m3_rne
from qtransform.formats.registry import E2M1

BLOCK = 16  # NVFP4's block: one E4M3 scale per 16 elements
BLOCK_MAX = 6.0 / ((17 / 16) * 0.93)  # Quartet II's backward_scale_override
SCALE_MAX = 255.99  # "Not 448 because eden needs space to rescale up a bit sometimes"


@dataclass(frozen=True)
class Eden:
    """The quantizer of one backward operand; `seed` is the base seed of its scale draws."""

    group: int = 128
    block_max: float = BLOCK_MAX
    scale_max: float = SCALE_MAX
    seed: int = 0

    stochastic = True  # the block scales are drawn: the backward gives it a stream

    def __post_init__(self) -> None:
        if self.group % BLOCK:
            raise ValueError(f"an EDEN group of {self.group} is not a multiple of NVFP4's block of {BLOCK}")

    def describe(self) -> str:
        return (f"nvfp4 EDEN group={self.group}, block_max={self.block_max:.6g}, "
                f"scale_max={self.scale_max:g}, rna elements, stochastic scales")

    def quantize(self, x: Tensor, seed: int | None = None, u: Tensor | None = None) -> Tensor:
        """x [rows, n] (n a multiple of `group`) quantized along its last axis, x's dtype out."""
        return eden_quantize(x, self.group, self.block_max, self.scale_max,
                             scale_uniforms(x, seed if seed is not None else self.seed) if u is None else u)


def scale_uniforms(x: Tensor, seed: int) -> Tensor:
    """The draws of x's block scales: one per block, at its row-major index."""
    return philox.uniform_at(seed, torch.arange(x.numel() // BLOCK, dtype=torch.int64, device=x.device))


def e4m3_neighbours(c: Tensor) -> tuple[Tensor, Tensor]:
    """(down, up): the E4M3 values around each c >= 0 with down <= c < up, found from c's
    nearest-even E4M3 code and the codes beside it (codes are monotone in value). As the
    reference: past 448 `up` is the NaN code."""
    bits = e4m3_rne(c).to(torch.float8_e4m3fn).view(torch.uint8)
    curr = bits.view(torch.float8_e4m3fn).to(torch.float32)
    prev = (bits - 1).view(torch.float8_e4m3fn).to(torch.float32)
    nxt = (bits + 1).view(torch.float8_e4m3fn).to(torch.float32)
    above = curr > c
    return torch.where(above, prev, curr), torch.where(above, curr, nxt)


def eden_quantize(x: Tensor, group: int, block_max: float, scale_max: float, u: Tensor) -> Tensor:
    """The EDEN quantization of x [rows, n] along its last axis (module docstring), with `u` one
    uniform per block scale in row-major order."""
    rows, n = x.shape
    if n % group:
        raise ValueError(f"EDEN: an axis of {n} is not a multiple of the group of {group}")
    v = x.to(torch.float32).reshape(-1, BLOCK)
    amax = v.abs().max()
    s_dec = torch.where(amax == 0, 1.0, amax / scale_max / block_max)
    s_b = e4m3_rne(v.abs().amax(dim=1, keepdim=True) / block_max / s_dec)
    s_b = torch.where(s_b == 0, 1.0, s_b)
    y = v / (s_b * s_dec)
    q = round_signed(torch.clamp(y, -6.0, 6.0), E2M1, "rna")
    yg, qg = y.reshape(-1, group), q.reshape(-1, group)
    num, den = (yg * yg).sum(dim=1, keepdim=True), (yg * qg).sum(dim=1, keepdim=True)
    corr = torch.where(den == 0, 1.0, num / den)
    c = (s_b.reshape(-1, group // BLOCK) * corr).reshape(-1, 1)
    down, up = e4m3_neighbours(c)
    s = torch.where(u.reshape(-1, 1).to(torch.float32) < (c - down) / (up - down), up, down)
    return (q * s * s_dec).reshape(rows, n).to(x.dtype)
