"""Symmetric int groups in ONNX: an fp32 scale amax / qmax per group."""

from __future__ import annotations

import numpy as np
import torch
from onnx import NodeProto, TensorProto

from qtransform.export.functions import (
    Body,
    OnnxFamily,
    amax_or_inf,
    initializer,
    register_onnx_family,
    round_signed,
)
from qtransform.formats.options import QuantConfig


def int_blocks(b: Body, x: str, axes: str, cfg: QuantConfig) -> str:
    """quantize_int: symmetric groups, scale amax / qmax."""
    elem = cfg.spec.element
    amax = amax_or_inf(b, x, axes)
    bad = b.op("IsInf", amax)
    scale = b.op("Where", bad, b.const(np.nan), b.op("Div", amax, b.const(float(elem.qmax))))
    div = b.op("Where", b.op("Or", b.op("Equal", scale, b.const(0.0)), bad), b.const(1.0), scale)
    q = round_signed(b, b.op("Div", x, div), elem, cfg.rounding)
    return b.op("Mul", q, scale)  # NaN scale: the reference's NaN q times NaN scale


def weight_scale(label: str, grid: torch.Tensor, tensor_scale: torch.Tensor | None,  # noqa: ARG001
                 cfg: QuantConfig) -> tuple[list[TensorProto], list[NodeProto]]:  # noqa: ARG001
    """The fp32 group scales."""
    return [initializer(f"{label}/scale", grid.numpy().astype(np.float32))], []


def activation_scale(b: Body, amax: str, cfg: QuantConfig) -> str:
    """amax / qmax, raised to the smallest normal (QuantizeLinear divides by it)."""
    scale = b.op("Div", amax, b.const(float(cfg.spec.element.qmax)))
    return b.op("Max", scale, b.const(2.0**-126))


register_onnx_family("int", OnnxFamily(int_blocks, weight_scale, activation_scale))
