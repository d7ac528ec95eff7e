"""Symmetric integers with an fp32 scale per group, row or tensor, no zero point.

Three conventions (`int_range`), because the stacks differ: "restricted" (the default) takes
scale = amax / qmax and codes in [-qmax, qmax]; "full" is compressed-tensors' (llm-compressor's
W4A16, W8A8): scale = amax / ((qmax - qmin) / 2), i.e. amax / 7.5 for int4 and amax / 127.5
for int8, codes clamped to [qmin, qmax] = [-8, 7] / [-128, 127]; "modelopt" is ModelOpt's
(`tensor_quant._tensor_quant`, its CPU path): a multiplier m = qmax / amax, q = clamp(round(x *
m), qmin, qmax), out = q / m, and amax <= 2^-24 quantizes to zeros.
"""

from __future__ import annotations

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, round_to_integer
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import (
    GRANULARITIES,
    INT4,
    INT8,
    ROUNDINGS,
    SCALE_DTYPES,
    Family,
    FormatSpec,
    register,
    register_family,
)
from qtransform.formats.scaled import MODELOPT_TINY, quantize_scaled, reciprocal_floor

INT_RANGES = ("restricted", "full", "modelopt", "vllm-per-token-head")


def quantize_int(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
                 amax_t: torch.Tensor | None = None, scale_t: torch.Tensor | None = None) -> BlockQuant:
    """q = clamp(round(x / scale)) on the integer grid of `int_range`; a zero scale gives
    signed zeros. A NaN or Inf in a group makes the whole group NaN, as for MX blocks.
    `scale_t`: a stored tensor scale, used as it is (not with int_range "modelopt", whose
    checkpoints qtransform does not open)."""
    qmax = cfg.spec.element.qmax
    if cfg.int_range == "modelopt":
        if scale_t is not None:
            raise ValueError(f"{cfg.name}: a stored scale with int_range 'modelopt'; ModelOpt "
                             "integer checkpoints are not read")
        return _modelopt(blocks, cfg, u, amax_t, float(qmax))
    if cfg.int_range == "vllm-per-token-head":
        return reciprocal_floor(blocks, cfg, u, amax_t, scale_t, -qmax - 1.0, float(qmax))
    if cfg.int_range == "full":
        return quantize_scaled(blocks, cfg, u, amax_t, cfg.spec.element, qmax + 0.5,
                               -qmax - 1.0, float(qmax), scale_t)
    return quantize_scaled(blocks, cfg, u, amax_t, cfg.spec.element, float(qmax),
                           -float(qmax), float(qmax), scale_t)


def _modelopt(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
              amax_t: torch.Tensor | None, qmax: float) -> BlockQuant:
    """ModelOpt's order: multiply by qmax / amax, round, clamp to [-qmax - 1, qmax], divide."""
    amax = blocks.abs().amax(dim=1) if amax_t is None else amax_t.expand(blocks.shape[0])
    bad = ~torch.isfinite(amax)
    tiny = amax <= MODELOPT_TINY
    m = torch.where(tiny, 0.0, amax.new_tensor(qmax) / amax)[:, None]  # a true division
    y = blocks * m
    r = torch.copysign(round_to_integer(y.abs(), cfg.rounding, u), y)
    q = torch.clamp(r, -qmax - 1.0, qmax)
    out = q / torch.where(tiny[:, None], 1.0, m)
    bad_b = bad[:, None]
    q, out = (torch.where(bad_b, CANONICAL_NAN, t) for t in (q, out))
    scale = torch.where(bad, CANONICAL_NAN, torch.where(tiny, 1.0, 1.0 / m[:, 0]))
    return BlockQuant(out=out, q=q, sat=((y > qmax) | (y < -qmax - 1.0)) & ~bad_b, scales=scale)


INT = register_family(Family(
    "int", {"rounding": ROUNDINGS, "int_range": INT_RANGES, "scale_dtype": SCALE_DTYPES},
    quantize=quantize_int, scale_values=lambda scales, tensor_scale, cfg: scales, kernel_id=2,
    per_tensor=lambda cfg: cfg.granularity == "tensor", granularities=GRANULARITIES,
))
for _name, _elem in [("int4", INT4), ("int8", INT8)]:
    register(FormatSpec(
        name=_name, family=INT, element=_elem, default_block=128, scale="fp32", tile=(128, 128),
        onnx_op=_name.upper() + "FakeQuant", allowed_blocks=None,
        description=f"symmetric {_name} with an fp32 scale per group, row or tensor "
                    f"(amax / {_elem.qmax}, or amax / {_elem.qmax + 0.5} with int_range full)",
    ))
