"""Symmetric integers in ONNX: an fp32 scale per group, row or tensor (`scaled.py`), and QDQ."""

from __future__ import annotations

import numpy as np
import torch
from onnx import NodeProto, TensorProto

from qtransform.export.families.scaled import block_amax, reciprocal_floor_blocks, scaled_blocks
from qtransform.export.functions import (
    Body,
    OnnxFamily,
    UnsupportedExport,
    initializer,
    register_onnx_family,
    round_to_integer,
    sign_of,
)
from qtransform.formats.options import QuantConfig
from qtransform.formats.scaled import MODELOPT_TINY


def int_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None,
               scale_t: str | None = None) -> str:
    """quantize_int: symmetric integers, scale amax / qmax or (int_range full) amax / (qmax + 0.5),
    or a stored `scale_t`."""
    qmax = float(cfg.spec.element.qmax)
    if cfg.int_range == "modelopt":
        if scale_t is not None:
            raise UnsupportedExport(f"{cfg.name}: a stored scale with int_range 'modelopt'")
        return _modelopt(b, x, axes, cfg, qmax)
    if cfg.int_range == "vllm-per-token-head":
        return reciprocal_floor_blocks(b, x, axes, cfg, -qmax - 1.0, qmax, amax_t, scale_t)
    if cfg.int_range == "full":
        return scaled_blocks(b, x, axes, cfg, cfg.spec.element, qmax + 0.5, -qmax - 1.0, qmax,
                             amax_t, scale_t)
    return scaled_blocks(b, x, axes, cfg, cfg.spec.element, qmax, -qmax, qmax, amax_t, scale_t)


def _modelopt(b: Body, x: str, axes: str, cfg: QuantConfig, qmax: float) -> str:
    """intgroup._modelopt: m = qmax / amax (0 at or below 2^-24), clamp(round(x * m)) / m."""
    if cfg.scale_dtype != "float32":
        raise UnsupportedExport(f"{cfg.name}: scale_dtype {cfg.scale_dtype!r} has no ONNX body; "
                                "export with scale_dtype 'float32'")
    amax = block_amax(b, x, axes, cfg)
    bad = b.op("IsInf", amax)
    tiny = b.op("LessOrEqual", amax, b.const(MODELOPT_TINY))
    m = b.op("Where", tiny, b.const(0.0), b.op("Div", b.const(qmax), amax))
    y = b.op("Mul", x, m)
    sign = sign_of(b, y)
    r = b.op("Mul", round_to_integer(b, b.op("Mul", y, sign), cfg.rounding), sign)
    q = b.op("Max", b.op("Min", r, b.const(qmax)), b.const(-qmax - 1.0))
    out = b.op("Div", q, b.op("Where", tiny, b.const(1.0), m))
    return b.op("Where", bad, b.const(np.nan), out)


def weight_scale(label: str, grid: torch.Tensor, tensor_scale: torch.Tensor | None,  # noqa: ARG001
                 cfg: QuantConfig) -> tuple[list[TensorProto], list[NodeProto]]:  # noqa: ARG001
    """The fp32 group scales."""
    return [initializer(f"{label}/scale", grid.numpy().astype(np.float32))], []


def activation_scale(b: Body, amax: str, cfg: QuantConfig) -> str:
    """amax / qmax, raised to the smallest normal (QuantizeLinear divides by it)."""
    scale = b.op("Div", amax, b.const(float(cfg.spec.element.qmax)))
    return b.op("Max", scale, b.const(2.0**-126))


register_onnx_family("int", OnnxFamily(int_blocks, weight_scale, activation_scale))
