"""Blockwise Walsh-Hadamard rotations: the reference every rotation path computes.

`H_b` is the Sylvester-ordered Walsh-Hadamard matrix of order b (a power of two), scaled by
1/sqrt(b) so that it is orthonormal and symmetric: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]
/ sqrt(2). A random Hadamard rotation is `D·H_b` with D = diag(signs); sign i of a seed is
+1 when the stochastic-rounding stream's draw `philox.uniform_at(seed, i)` is below 1/2, else
-1 (documented, device independent). `rotate(x, b, signs)` applies it to the last axis, block by
block of b consecutive elements: y = (x * signs) @ H_b per block. Because D·H_b is orthogonal, a
Linear whose input and weight are both rotated along the reduction axis computes the same
product in exact arithmetic: (x·R)(W·R)ᵀ = x·Wᵀ.

`fwht` computes the same rotation in O(n log b) instead of the reference's O(n b): the compiled
CPU kernel (fastpath.py, qfast.c), the Triton kernel on CUDA (triton_kernels.py) or the torch
butterfly below, all three the same fp32 operations in the same order (bit-identical to each
other, tested) and equal to `rotate` up to fp32 rounding. `rotate_fake_quantize` is the rotation
followed by fake quantization with the rotated values kept in one buffer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from qtransform.formats import fastpath, philox
from qtransform.formats.options import QuantConfig, resolve
from qtransform.formats.quantize import check_input, fake_quantize, layout_for, stream_seed
from qtransform.formats.registry import FormatSpec

FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # read and written by qfast.c


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ...: the orders a Sylvester Hadamard matrix exists for."""
    return n >= 1 and n & (n - 1) == 0


def hadamard_matrix(b: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Tensor:
    """H_b / sqrt(b), Sylvester order, built in float64 and rounded once to `dtype`."""
    if not is_power_of_two(b):
        raise ValueError(f"a Hadamard block size must be a power of two, got {b}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(dtype=dtype, device=device)


def random_signs(b: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """The ±1 diagonal of a random Hadamard rotation of order b (float32)."""
    u = philox.uniform_at(seed, torch.arange(b, dtype=torch.int64, device=device))
    return torch.where(u < 0.5, 1.0, -1.0).to(torch.float32)


def rotate(x: Tensor, block_size: int, signs: Tensor | None = None) -> Tensor:
    """x rotated along its last axis, per block of `block_size`: (x * signs) @ H_b per block.

    Computed as a dense matmul in float32 (the reference); the fast transforms elsewhere must
    agree with it to rounding. The last axis must be a multiple of `block_size`.
    """
    n = x.shape[-1]
    if n % block_size:
        raise ValueError(f"axis of {n} is not a multiple of the block size {block_size}")
    dtype = x.dtype
    xb = x.to(torch.float32).reshape(*x.shape[:-1], n // block_size, block_size)
    if signs is not None:
        xb = xb * signs.to(device=x.device, dtype=torch.float32)
    h = hadamard_matrix(block_size, torch.float32, x.device)
    return (xb @ h).reshape(x.shape).to(dtype)


def _checked(x: Tensor, block_size: int, signs: Tensor | None) -> None:
    n = x.shape[-1] if x.dim() else 0
    if not is_power_of_two(block_size):
        raise ValueError(f"a Hadamard block size must be a power of two, got {block_size}")
    if x.dim() == 0 or n % block_size:
        raise ValueError(f"axis of {n} is not a multiple of the block size {block_size}")
    if signs is not None and tuple(signs.shape) != (block_size,):
        raise ValueError(f"signs must have shape ({block_size},), got {tuple(signs.shape)}")


def scale_of(block_size: int) -> float:
    """fl32(1/sqrt(b)), the one multiplication every fast path ends with."""
    return float(torch.tensor(1.0 / math.sqrt(block_size), dtype=torch.float32))


def butterfly(x: Tensor, block_size: int, signs: Tensor | None = None) -> Tensor:
    """The torch fast transform (any device): per stage h = 1, 2, .. b/2 one vectorized
    (a + c, a - c) over the pairs h apart, then the scale; x's dtype out, fp32 inside."""
    _checked(x, block_size, signs)
    n = x.shape[-1]
    v = x.to(torch.float32).reshape(-1, n)
    if signs is not None:
        v = (v.reshape(-1, n // block_size, block_size) * signs.to(v.device, torch.float32)).reshape(-1, n)
    h = 1
    while h < block_size:
        pairs = v.reshape(v.shape[0], n // (2 * h), 2, h)
        lo, hi = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack((lo + hi, lo - hi), dim=2).reshape(-1, n)
        h *= 2
    v = v * torch.tensor(scale_of(block_size), dtype=torch.float32, device=v.device)
    return v.reshape(x.shape).to(x.dtype)


def _transform(x: Tensor, block_size: int, signs: Tensor | None) -> Tensor:
    """The fastest path that applies: compiled CPU kernel, Triton on CUDA, else the butterfly."""
    if x.is_cpu:
        out = fastpath.fwht(x, block_size, signs, scale_of(block_size))
        if out is not None:
            return out
    elif x.device.type == "cuda" and fastpath.enabled():
        try:
            from qtransform.formats import triton_kernels
        except ImportError:
            triton_kernels = None  # type: ignore[assignment]
        if triton_kernels is not None and x.dtype in triton_kernels.FWHT_DTYPES:
            return triton_kernels.fwht(x, block_size, signs, scale_of(block_size))
    return butterfly(x, block_size, signs)


class _FWHT(torch.autograd.Function):
    """y = (x * s) H per block; H symmetric, so dL/dx = (g H) * s: the transform again."""

    @staticmethod
    def forward(ctx, x, block_size, signs):  # type: ignore[override]
        ctx.block_size, ctx.signs = block_size, signs
        return _transform(x, block_size, signs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        g = _transform(grad, ctx.block_size, None)
        if ctx.signs is not None:
            b = ctx.block_size
            g = (g.reshape(*g.shape[:-1], -1, b) * ctx.signs.to(g.device, g.dtype)).reshape(grad.shape)
        return g, None, None


def fwht(x: Tensor, block_size: int, signs: Tensor | None = None) -> Tensor:
    """`rotate(x, block_size, signs)` in O(n log b): a new tensor (x untouched) in x's dtype,
    differentiable, equal to the dense reference up to fp32 rounding (see module docstring)."""
    _checked(x, block_size, signs)
    return _FWHT.apply(x, block_size, signs)


def rotate_fake_quantize(x: Tensor, block_size: int, signs: Tensor | None,
                         fmt: str | FormatSpec | QuantConfig, **options: Any) -> Tensor:
    """fake_quantize(fwht(x, block_size, signs), fmt, **options), the same bits: what a rotated
    weight or activation becomes. Without autograd on CPU, blocks along the last axis, the
    compiled quantizer rewrites the rotated buffer in place (no second tensor, no second
    allocation: the fused path that keeps a rotated MXFP4 weight under 2x the plain one);
    otherwise the two steps run as they are (straight-through gradient through both)."""
    y = fwht(x, block_size, signs)
    if (y.is_cpu and y.dtype in FUSED_DTYPES and not (torch.is_grad_enabled() and x.requires_grad)
            and not {"generator", "amax"} & options.keys()):
        opts = dict(options)
        seed = opts.pop("seed", None)
        cfg = resolve(fmt, **opts)
        check_input(y, cfg)
        layout = layout_for(y, cfg)
        if (not layout.tile and layout.axis == y.ndim - 1 and layout.shape == tuple(y.shape)
                and fastpath.quantize(y, cfg, layout, False, seed=stream_seed(cfg, None, seed, y.device),
                                      out=y) is not None):
            return y
    return fake_quantize(y, fmt, **options)
