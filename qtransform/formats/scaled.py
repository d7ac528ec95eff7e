"""Formats whose scale is one plain number per block, row or tensor (fp32 by default).

The int family and the FP8 family share this kernel: scale = amax / divisor, a zero scale
replaced by the scale dtype's epsilon, elements x / scale clamped to [lo, hi] and rounded, and
out = q * scale. That is compressed-tensors' order of operations (calculate_qparams, then
_quantize_dequantize: a true division, clamp before rounding), so the deployment stacks' FP8
and integer schemes are reproduced bit for bit; docs/numerics.md has the derivation.
`scale_dtype` rounds the scale and the quotient to a narrower float, as compressed-tensors does
for a bf16/fp16 model (its scales take the model's dtype).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, round_signed, round_to_integer
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import SCALE_TORCH_DTYPES, ElementSpec

_DTYPES = SCALE_TORCH_DTYPES
# ModelOpt's smallest amax it scales by: at or below it, its FP8 scales by 1 and its integers
# quantize the block to zeros (`fp8.py`, `intgroup.py`)
MODELOPT_TINY = 2.0**-24
# vLLM's per-token-head cache writers floor every scale at this value (`_reshape_cache_per_token_head`)
PER_TOKEN_HEAD_MIN_SCALE = 1e-6
_NAMES = {v: k for k, v in _DTYPES.items()}


def bind_dtype(cfg: QuantConfig, dtype: torch.dtype) -> QuantConfig:
    """`scale_dtype="input"` made concrete for an input of `dtype` (fp32 for any other)."""
    if cfg.scale_dtype != "input":
        return cfg
    return replace(cfg, scale_dtype=_NAMES.get(dtype, "float32"))


def _round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t rounded to `dtype` (nearest even) and held in fp32. An fp32 quotient or product of
    two `dtype` values rounded so equals the correctly rounded `dtype` operation: fp32 carries
    more than twice the bits of bf16 / fp16 plus two, where double rounding is innocuous."""
    return t if dtype == torch.float32 else t.to(dtype).to(torch.float32)


def quantize_scaled(
    blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None, amax_t: torch.Tensor | None,
    elem: ElementSpec, divisor: float, lo: float, hi: float, scale_t: torch.Tensor | None = None,
) -> BlockQuant:
    """Quantize `[n, block]` fp32 blocks with scale = amax / divisor (amax: each block's, or
    `amax_t` for every block: granularity "tensor" or a caller's override), or with a stored
    `scale_t` for every block as it is (a checkpoint's static scale); elements x / scale
    clamped to [lo, hi] (lo = -hi, or -(qmax + 1) for integers over their full range) and
    rounded on `elem`'s grid. A NaN or Inf amax (scale) makes the block NaN, as for MX blocks."""
    dtype = _DTYPES[cfg.scale_dtype]
    if scale_t is not None:  # compressed-tensors divides by the stored scale, held in `dtype`
        scale = _round_to(scale_t.expand(blocks.shape[0]), dtype)
        bad = ~torch.isfinite(scale)
    else:
        amax = blocks.abs().amax(dim=1) if amax_t is None else amax_t.expand(blocks.shape[0])
        amax = _round_to(amax, dtype)
        bad = ~torch.isfinite(amax)
        scale = _round_to(amax / amax.new_tensor(divisor), dtype)  # a true division on every device
    scale = torch.where(scale == 0, torch.finfo(dtype).eps, scale)
    scale = torch.where(bad, CANONICAL_NAN, scale)
    sb = scale[:, None]
    y = _round_to(blocks / sb, dtype)
    c = torch.clamp(y, lo, hi)
    if elem.kind == "int":
        q = torch.copysign(round_to_integer(c.abs(), cfg.rounding, u), c)
    else:
        q = round_signed(c, elem, cfg.rounding, u)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, q)
    out = torch.where(bad_b, CANONICAL_NAN, q * sb)
    return BlockQuant(out=out, q=q, sat=((y > hi) | (y < lo)) & ~bad_b, scales=scale)


def reciprocal_floor(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
                     amax_t: torch.Tensor | None, scale_t: torch.Tensor | None,
                     lo: float, hi: float) -> BlockQuant:
    """vLLM's per-token-head cache writer (FP8 and INT8 alike, per token and KV head): s =
    max(fl(amax / max), 1e-6) in fp32 (a stored `scale_t` as it is), y = x * fl(1 / s),
    clamped to [lo, hi] and rounded (the config's rounding: the engine's int8 adds +-0.5 and
    truncates, "rna"; its fp8 store rounds to nearest even), out = q * s."""
    elem = cfg.spec.element
    if scale_t is not None:
        s = scale_t.expand(blocks.shape[0])
    else:
        amax = blocks.abs().amax(dim=1) if amax_t is None else amax_t.expand(blocks.shape[0])
        s = torch.clamp_min(amax / amax.new_tensor(elem.max_normal), PER_TOKEN_HEAD_MIN_SCALE)
    bad = ~torch.isfinite(s)
    raw = blocks * torch.reciprocal(s)[:, None]
    y = torch.clamp(raw, lo, hi)
    if elem.kind == "int":
        q = torch.copysign(round_to_integer(y.abs(), cfg.rounding, u), y)
    else:
        q = round_signed(y, elem, cfg.rounding, u)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, q)
    scales = torch.where(bad, CANONICAL_NAN, s)
    return BlockQuant(out=q * scales[:, None], q=q, sat=((raw > hi) | (raw < lo)) & ~bad_b, scales=scales)
