"""The ONNX body shared by the families whose scale is one plain fp32 number (int, fp8):
`qtransform.formats.scaled.quantize_scaled` operation for operation."""

from __future__ import annotations

import numpy as np

from qtransform.export.functions import (
    Body,
    UnsupportedExport,
    round_signed,
    round_to_integer,
    sign_of,
)
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import ElementSpec
from qtransform.formats.scaled import PER_TOKEN_HEAD_MIN_SCALE


def block_amax(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None) -> str:
    """max |x| per block (the whole tensor's for granularity "tensor", or a given `amax_t`:
    `fake_quantize`'s amax), +inf where the block (tensor) holds a NaN or an Inf."""
    if amax_t is not None:
        return b.op("Where", b.op("IsNaN", amax_t), b.const(np.inf), amax_t)
    a = b.op("Abs", x)
    clean = b.op("Where", b.op("IsNaN", a), b.const(np.inf), a)
    if cfg.granularity == "tensor":
        return b.op("ReduceMax", clean, keepdims=0)
    return b.op("ReduceMax", clean, axes, keepdims=1)


def scaled_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, elem: ElementSpec,
                  divisor: float, lo: float, hi: float, amax_t: str | None = None,
                  scale_t: str | None = None) -> str:
    """scale = amax / divisor (the whole tensor's amax for granularity "tensor", or `amax_t`)
    or a stored `scale_t`, zero -> fp32 eps, q = round(clamp(x / scale, lo, hi)), out = q *
    scale; a NaN/Inf block (scale) is NaN."""
    if cfg.scale_dtype != "float32":
        raise UnsupportedExport(f"{cfg.name}: scale_dtype {cfg.scale_dtype!r} has no ONNX body; "
                                "export with scale_dtype 'float32'")
    if scale_t is not None:
        bad = b.op("Or", b.op("IsNaN", scale_t), b.op("IsInf", scale_t))
        scale = scale_t
    else:
        amax = block_amax(b, x, axes, cfg, amax_t)
        bad = b.op("IsInf", amax)
        scale = b.op("Div", amax, b.const(divisor))
    scale = b.op("Where", b.op("Equal", scale, b.const(0.0)),
                 b.const(np.finfo(np.float32).eps), scale)
    scale = b.op("Where", bad, b.const(np.nan), scale)
    c = b.op("Max", b.op("Min", b.op("Div", x, scale), b.const(hi)), b.const(lo))
    if elem.kind == "int":
        # lo may be -(qmax + 1): round the magnitude without the element's saturation
        sign = sign_of(b, c)
        q = b.op("Mul", round_to_integer(b, b.op("Mul", c, sign), cfg.rounding), sign)
    else:
        q = round_signed(b, c, elem, cfg.rounding)
    return b.op("Mul", q, scale)  # NaN scale: NaN out


def reciprocal_floor_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, lo: float, hi: float,
                            amax_t: str | None = None, scale_t: str | None = None) -> str:
    """`qtransform.formats.scaled.reciprocal_floor`: s = max(amax / max, 1e-6) or a stored
    `scale_t`, q = round(clamp(x * fl(1 / s), lo, hi)), out = q * s; a NaN/Inf block is NaN."""
    elem = cfg.spec.element
    if scale_t is not None:
        s = scale_t
    else:
        amax = block_amax(b, x, axes, cfg, amax_t)
        s = b.op("Max", b.op("Div", amax, b.const(elem.max_normal)), b.const(PER_TOKEN_HEAD_MIN_SCALE))
    bad = b.op("Or", b.op("IsNaN", s), b.op("IsInf", s))
    c = b.op("Max", b.op("Min", b.op("Mul", x, b.op("Reciprocal", s)), b.const(hi)), b.const(lo))
    if elem.kind == "int":
        sign = sign_of(b, c)
        q = b.op("Mul", round_to_integer(b, b.op("Mul", c, sign), cfg.rounding), sign)
    else:
        q = round_signed(b, c, elem, cfg.rounding)
    return b.op("Where", bad, b.const(np.nan), b.op("Mul", q, s))
