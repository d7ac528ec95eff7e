"""FP8 with a plain fp32 scale in ONNX: the shared body of `scaled.py` with a saturating
float8 rounding, or ModelOpt's order. No QDQ form (yet): function and inline modes."""

from __future__ import annotations

import numpy as np

from qtransform.export.families.scaled import block_amax, reciprocal_floor_blocks, scaled_blocks
from qtransform.export.functions import (
    Body,
    OnnxFamily,
    UnsupportedExport,
    register_onnx_family,
    round_signed,
)
from qtransform.formats.fp8 import VLLM_CPU_SUBNORMAL_GRID
from qtransform.formats.options import QuantConfig
from qtransform.formats.scaled import MODELOPT_TINY


def fp8_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None,
               scale_t: str | None = None) -> str:
    """quantize_fp8: quantize_scaled with divisor and clamp at the element's max normal, or
    ModelOpt's reciprocal multiplier; a stored `scale_t` s as quantize_fp8 uses it."""
    top = cfg.spec.max_normal
    if cfg.fp8_variant == "default":
        return scaled_blocks(b, x, axes, cfg, cfg.spec.element, top, -top, top, amax_t, scale_t)
    if cfg.scale_dtype != "float32":
        raise UnsupportedExport(f"{cfg.name}: scale_dtype {cfg.scale_dtype!r} has no ONNX body; "
                                "export with scale_dtype 'float32'")
    if cfg.fp8_variant == "vllm-cpu":
        return _vllm_cpu(b, x, axes, cfg, amax_t, scale_t)
    if cfg.fp8_variant == "vllm-per-token-head":
        return reciprocal_floor_blocks(b, x, axes, cfg, -top, top, amax_t, scale_t)
    if scale_t is not None:  # the serving kernels' inverted scale fl(1 / s), dequantized by s
        amax = b.op("Where", b.op("Or", b.op("IsNaN", scale_t), b.op("IsInf", scale_t)),
                    b.const(np.inf), b.const(0.0))  # +inf marks a NaN / Inf scale, as amax does
        m, inv = b.op("Reciprocal", scale_t), scale_t
    else:
        amax = block_amax(b, x, axes, cfg, amax_t)
        safe = b.op("Where", b.op("LessOrEqual", amax, b.const(MODELOPT_TINY)), b.const(1.0), amax)
        m = b.op("Mul", b.op("Reciprocal", safe), b.const(top))
        inv = b.op("Reciprocal", m)
    y = b.op("Max", b.op("Min", b.op("Mul", x, m), b.const(top)), b.const(-top))
    out = b.op("Mul", round_signed(b, y, cfg.spec.element, cfg.rounding), inv)
    return b.op("Where", b.op("IsInf", amax), b.const(np.nan), out)


def _vllm_cpu(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None, scale_t: str | None) -> str:
    """quantize_fp8's "vllm-cpu" variant: x times fl(1 / s), clamped, e4m3 subnormals pre-rounded."""
    top = cfg.spec.max_normal
    if scale_t is not None:
        s = scale_t
    else:
        amax = block_amax(b, x, axes, cfg, amax_t)
        s = b.op("Div", amax, b.const(top))
        s = b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(1.0), s)
    bad = b.op("Or", b.op("IsNaN", s), b.op("IsInf", s))
    y = b.op("Max", b.op("Min", b.op("Mul", x, b.op("Reciprocal", s)), b.const(top)), b.const(-top))
    if cfg.spec.element.name == "e4m3":
        grid = VLLM_CPU_SUBNORMAL_GRID
        fine = b.op("Mul", b.op("Round", b.op("Mul", y, b.const(1.0 / grid))), b.const(grid))
        y = b.op("Where", b.op("Less", b.op("Abs", y), b.const(2.0**-6)), fine, y)
    out = b.op("Mul", round_signed(b, y, cfg.spec.element, cfg.rounding), s)
    return b.op("Where", bad, b.const(np.nan), out)


register_onnx_family("fp8", OnnxFamily(fp8_blocks))
