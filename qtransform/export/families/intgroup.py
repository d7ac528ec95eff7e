"""Symmetric integers in ONNX: an fp32 scale per group, row or tensor (`scaled.py`), and QDQ."""

from __future__ import annotations

import numpy as np
import torch
from onnx import NodeProto, TensorProto

from qtransform.export.families.scaled import scaled_blocks
from qtransform.export.functions import Body, OnnxFamily, initializer, register_onnx_family
from qtransform.formats.options import QuantConfig


def int_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None) -> str:
    """quantize_int: symmetric integers, scale amax / qmax or (int_range full) amax / (qmax + 0.5)."""
    qmax = float(cfg.spec.element.qmax)
    if cfg.int_range == "full":
        return scaled_blocks(b, x, axes, cfg, cfg.spec.element, qmax + 0.5, -qmax - 1.0, qmax, amax_t)
    return scaled_blocks(b, x, axes, cfg, cfg.spec.element, qmax, -qmax, qmax, amax_t)


def weight_scale(label: str, grid: torch.Tensor, tensor_scale: torch.Tensor | None,  # noqa: ARG001
                 cfg: QuantConfig) -> tuple[list[TensorProto], list[NodeProto]]:  # noqa: ARG001
    """The fp32 group scales."""
    return [initializer(f"{label}/scale", grid.numpy().astype(np.float32))], []


def activation_scale(b: Body, amax: str, cfg: QuantConfig) -> str:
    """amax / qmax, raised to the smallest normal (QuantizeLinear divides by it)."""
    scale = b.op("Div", amax, b.const(float(cfg.spec.element.qmax)))
    return b.op("Max", scale, b.const(2.0**-126))


register_onnx_family("int", OnnxFamily(int_blocks, weight_scale, activation_scale))
