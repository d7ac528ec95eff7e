"""Symmetric integer groups: an fp32 scale amax / qmax per group, no zero point."""

from __future__ import annotations

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, divide, round_signed
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import (
    INT4,
    INT8,
    ROUNDINGS,
    Family,
    FormatSpec,
    register,
    register_family,
)


def quantize_int(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None) -> BlockQuant:
    """q = clamp(round(x / scale), -qmax, qmax); a zero (or underflowed) scale gives signed zeros.

    A NaN or Inf in a group makes the whole group NaN, as for MX blocks.
    """
    elem = cfg.spec.element
    amax = blocks.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)
    scale = torch.where(bad, CANONICAL_NAN, divide(amax, elem.qmax))
    div = torch.where((scale == 0) | bad, 1.0, scale)[:, None]
    y = blocks / div
    q = round_signed(y, elem, cfg.rounding, u)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, q)
    # NaN * NaN is the first operand's NaN on CPU but 0x7fffffff on CUDA: write the canonical one
    out = torch.where(bad_b, CANONICAL_NAN, q * scale[:, None])
    return BlockQuant(out=out, q=q, sat=(y.abs() > elem.qmax) & ~bad_b, scales=scale)


INT = register_family(Family(
    "int", {"rounding": ROUNDINGS},
    quantize=lambda blocks, cfg, u, amax_t: quantize_int(blocks, cfg, u),
    scale_values=lambda scales, tensor_scale, cfg: scales, kernel_id=2,
))
for _name, _elem in [("int4", INT4), ("int8", INT8)]:
    register(FormatSpec(
        name=_name, family=INT, element=_elem, default_block=128, scale="fp32", tile=(128, 128),
        onnx_op=_name.upper() + "FakeQuant", allowed_blocks=None,
        description=f"symmetric {_name} groups with an fp32 scale per group (amax / {_elem.qmax})",
    ))
