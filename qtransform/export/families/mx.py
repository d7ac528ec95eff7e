"""MX in ONNX: the E8M0 shared exponent computed exactly, and E8M0-scaled QDQ."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import NodeProto, TensorProto

from qtransform.export.functions import (
    Body,
    OnnxFamily,
    amax_or_inf,
    initializer,
    pow2,
    register_onnx_family,
    round_signed,
    shared_exponent,
)
from qtransform.formats.options import QuantConfig


def _scale(b: Body, amax: str, bad: str, cfg: QuantConfig) -> str:
    """2^E per block (mx.quantize_mx): zero blocks 2^-127; NaN/Inf blocks (`bad`) get a
    placeholder the callers mask."""
    zero = b.op("Equal", amax, b.const(0.0))
    safe = b.op("Where", b.op("Or", bad, zero), b.const(1.0), amax)
    e = b.op("Where", zero, b.const(-127.0), shared_exponent(b, safe, cfg.spec.element, cfg.scale_rule))
    return pow2(b, e)


def mx_blocks(b: Body, x: str, axes: str, cfg: QuantConfig) -> str:
    """quantize_mx on a blocked tensor (block maxima reduce over `axes`)."""
    amax = amax_or_inf(b, x, axes)
    bad = b.op("IsInf", amax)
    scale = _scale(b, amax, bad, cfg)
    q = round_signed(b, b.op("Div", x, scale), cfg.spec.element, cfg.rounding)
    nan_or_one = b.op("Where", bad, b.const(np.nan), b.const(1.0))  # per block: keeps -0.0
    return b.op("Mul", b.op("Mul", q, scale), nan_or_one)


def weight_scale(label: str, grid: torch.Tensor, tensor_scale: torch.Tensor | None,  # noqa: ARG001
                 cfg: QuantConfig) -> tuple[list[TensorProto], list[NodeProto]]:  # noqa: ARG001
    """The stored E8M0 codes are the scale."""
    codes = grid.numpy().astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return [initializer(f"{label}/scale", codes)], []


def activation_scale(b: Body, amax: str, cfg: QuantConfig) -> str:
    """2^E from the block maxima (zero blocks: 2^-127)."""
    return _scale(b, amax, b.op("IsInf", amax), cfg)


register_onnx_family("mx", OnnxFamily(mx_blocks, weight_scale, activation_scale,
                                      activation_scale_type=TensorProto.FLOAT8E8M0))
