"""NVFP4 in ONNX: each variant's fp32 order of operations, and two-level QDQ (E4M3 block
scales times one fp32 decode scale)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import NodeProto, TensorProto, helper

from qtransform.export.functions import (
    FLT_MAX,
    Body,
    OnnxFamily,
    UnsupportedExport,
    amax_nan,
    amax_or_inf,
    initializer,
    register_onnx_family,
    round_magnitude,
    round_signed,
)
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import E4M3


def _e4m3(b: Body, v: str) -> str:
    return round_magnitude(b, v, E4M3, "rne")


def _clamp6(b: Body, y: str) -> str:
    return b.op("Max", b.op("Min", y, b.const(6.0)), b.const(-6.0))


def nvfp4_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None,
                 scale_t: str | None = None) -> str:
    """quantize_nvfp4 in the variant's fp32 order of operations; `amax_t` replaces the tensor's
    own amax (`fake_quantize`'s amax: a fixed value, or one per row), `scale_t` is a stored
    tensor scale (`fake_quantize`'s scale: g for compressed-tensors, d for the others)."""
    if cfg.four_over_six_order != "pairwise":
        raise UnsupportedExport(f"nvfp4 four_over_six_order {cfg.four_over_six_order!r} has no "
                                "ONNX form; export with four_over_six_order 'pairwise'")
    elem = cfg.spec.element
    if cfg.nvfp4_variant == "one_level":
        s = _e4m3(b, b.op("Min", b.op("Div", amax_nan(b, x, axes), b.const(6.0)), b.const(448.0)))
        sz = b.op("Equal", s, b.const(0.0))
        # where(s == 0, x * 0.0, x / s) without routing signed zeros through a Where
        div = b.op("Div", x, b.op("Where", sz, b.const(1.0), s))
        y = b.op("Mul", div, b.op("Where", sz, b.const(0.0), b.const(1.0)))
        return b.op("Mul", round_signed(b, _clamp6(b, y), elem, cfg.rounding), s)
    if amax_t is None and scale_t is None:
        amax_t = amax_nan(b, x, None)
    if cfg.nvfp4_variant == "default":
        if scale_t is not None:
            raise UnsupportedExport("nvfp4: a stored tensor scale takes nvfp4_variant "
                                    "'compressed-tensors' or 'modelopt'")
        amax_b = amax_or_inf(b, x, axes)  # a NaN anywhere makes every output NaN through g
        g_range = 6.0 * float(cfg.global_bound)  # 2688 or 1536
        g = b.op("Min", b.op("Div", b.const(g_range), amax_t), b.const(FLT_MAX))
        g = b.op("Where", b.op("Equal", g, b.const(0.0)), b.const(1.0), g)
        d = b.op("Div", b.const(1.0), g)
        d = b.op("Min", d, b.const(FLT_MAX))  # no-op on values; stops Div(1,g)*s becoming s/g
        s = _default_scale(b, amax_b, g, np.float32(1 / 6))
        if cfg.four_over_six != "none":
            s4 = _default_scale(b, amax_b, g, np.float32(0.25))
            four = b.op("Less", _block_error(b, _default_out(b, x, s4, d, cfg), x, axes, cfg),
                        _block_error(b, _default_out(b, x, s, d, cfg), x, axes, cfg))
            # a tie (or NaN) keeps max/6; the scale is chosen, then the elements computed once
            # more with it (Where would lose the -0.0 of a chosen element)
            s = b.op("Where", four, s4, s)
        return _default_out(b, x, s, d, cfg)
    if cfg.nvfp4_variant == "vllm-kv":
        return _vllm_kv(b, x, axes, cfg, amax_t, scale_t)
    if cfg.nvfp4_variant == "flashinfer-kv":
        return _flashinfer_kv(b, x, axes, cfg, amax_t, scale_t)
    if cfg.nvfp4_variant == "vllm":
        return _vllm(b, x, axes, cfg, amax_t, scale_t)
    if cfg.nvfp4_variant == "modelopt":
        sd = _modelopt_scale(b, amax_nan(b, x, axes), amax_t, scale_t)
        y = b.op("Div", x, sd)
        qa = round_magnitude(b, b.op("Abs", _clamp6(b, y)), elem, cfg.rounding)
        q = b.op("Mul", qa, b.op("Where", b.op("Less", y, b.const(0.0)), b.const(-1.0), b.const(1.0)))
        q = b.op("Where", b.op("Equal", qa, b.const(0.0)), b.const(0.0), q)  # ModelOpt's zeros are +0
        return b.op("Mul", q, sd)
    if cfg.nvfp4_variant != "compressed-tensors":  # every other variant returned above
        raise UnsupportedExport(f"nvfp4: nvfp4_variant {cfg.nvfp4_variant!r} has no ONNX body; "
                                "export a policy without it")
    amax_b = amax_nan(b, x, axes)  # a NaN block is all NaN here (g ignores amax_t's NaN)
    if scale_t is None:
        recip = b.op("Min", b.op("Div", b.const(1.0), amax_t), b.const(np.inf))  # stops Div-Mul fusion
        g = b.op("Mul", recip, b.const(2688.0))
    else:
        g = scale_t
    g = b.op("Where", b.op("Or", b.op("IsNaN", g), b.op("IsInf", g)), b.const(1.0), g)
    s = b.op("Mul", g, b.op("Div", amax_b, b.const(6.0)))
    s = _e4m3(b, b.op("Max", b.op("Min", s, b.const(448.0)), b.const(-448.0)))
    s = b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(0.125), s)
    scale = b.op("Div", s, g)
    y = b.op("Div", x, scale)
    qa = round_magnitude(b, b.op("Abs", _clamp6(b, y)), elem, cfg.rounding)
    q = b.op("Mul", qa, b.op("Where", b.op("Less", y, b.const(0.0)), b.const(-1.0), b.const(1.0)))
    return b.op("Mul", q, scale)


def _vllm_kv(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None,
             scale_t: str | None) -> str:
    """`formats.nvfp4_kv.quantize_vllm_kv`: vLLM's NVFP4 KV-cache writer, with its four over six
    (squared errors summed pair by pair in element order)."""
    k = scale_t if scale_t is not None else b.op("Div", amax_t, b.const(448.0))
    k = b.op("Where", b.op("Equal", k, b.const(0.0)), b.const(1.0), k)
    g = b.op("Div", b.const(1.0), k)
    inv_g = b.op("Div", b.const(1.0), g)
    amax_b = amax_nan(b, x, axes)

    def candidate(factor: np.float32) -> tuple[str, str]:
        sf = _e4m3(b, b.op("Min", b.op("Mul", g, b.op("Mul", amax_b, b.const(factor))), b.const(448.0)))
        zero = b.op("Equal", sf, b.const(0.0))
        enc = b.op("Div", b.const(1.0), b.op("Mul", sf, inv_g))
        return sf, b.op("Where", zero, b.const(0.0), enc)

    def error(enc: str) -> str:
        zero = b.op("Equal", enc, b.const(0.0))
        dec = b.op("Where", zero, b.const(0.0), b.op("Div", b.const(1.0), enc))
        q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), cfg.spec.element, "rne")
        d = b.op("Where", zero, x, b.op("Sub", b.op("Mul", q, dec), x))
        sq = b.op("Mul", d, d)
        width = b.op("Gather", b.op("Shape", sq), axes)  # a block cut to a shorter axis: zeros
        pads = b.op("Concat", b.ints(0), b.op("Sub", b.ints(cfg.block), width), axis=0)
        sq = b.op("Pad", sq, pads, b.const(0.0), axes)
        err = None
        for i in range(0, cfg.block, 2):
            pair = b.op("Add", b.op("Slice", sq, b.ints(i), b.ints(i + 1), axes),
                        b.op("Slice", sq, b.ints(i + 1), b.ints(i + 2), axes))
            err = pair if err is None else b.op("Add", err, pair)
        return err

    sf, enc = candidate(np.float32(1 / 6))
    if cfg.four_over_six == "mse":
        sf4, enc4 = candidate(np.float32(0.25))
        four = b.op("Less", error(enc4), error(enc))  # a tie keeps max/6
        sf, enc = b.op("Where", four, sf4, sf), b.op("Where", four, enc4, enc)
    q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), cfg.spec.element, cfg.rounding)
    return b.op("Mul", b.op("Mul", q, sf), k)


def _flashinfer_kv(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None,
                   scale_t: str | None) -> str:
    """`formats.nvfp4_kv.quantize_flashinfer_kv`: FlashInfer's NVFP4 KV-cache writer, SF =
    e4m3(amax_b / (6 · k)), q = e2m1(x · 1 / (SF · k)), out = (q · SF) · k."""
    k = scale_t if scale_t is not None else b.op("Div", amax_t, b.const(448.0))
    k = b.op("Where", b.op("Equal", k, b.const(0.0)), b.const(1.0), k)
    amax_b = amax_nan(b, x, axes)
    sf = _e4m3(b, b.op("Min", b.op("Div", amax_b, b.op("Mul", b.const(6.0), k)), b.const(448.0)))
    zero = b.op("Equal", sf, b.const(0.0))
    enc = b.op("Where", zero, b.const(0.0), b.op("Div", b.const(1.0), b.op("Mul", sf, k)))
    q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), cfg.spec.element, cfg.rounding)
    return b.op("Mul", b.op("Mul", q, sf), k)


def _vllm(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None, scale_t: str | None) -> str:
    """`formats.nvfp4._vllm` without four over six (FlashInfer's order has no ONNX form): g
    stored or 2688 / amax, SF = e4m3(g · (amax_b · fl(1/6))), q = e2m1(x / (SF · fl(1/g))) by
    the reciprocal, out = (q · SF) · fl(1/g)."""
    if cfg.four_over_six != "none":
        raise UnsupportedExport("nvfp4_variant 'vllm' with four_over_six (FlashInfer's order) has no "
                                "ONNX form; export without four_over_six")
    if scale_t is not None:
        g = scale_t
    else:
        g = b.op("Min", b.op("Div", b.const(2688.0), amax_t), b.const(FLT_MAX))
        g = b.op("Where", b.op("Equal", g, b.const(0.0)), b.const(1.0), g)
    d = b.op("Min", b.op("Div", b.const(1.0), g), b.const(FLT_MAX))  # Min: no Div-Mul fusion
    amax_b = amax_nan(b, x, axes)
    sf = _e4m3(b, b.op("Min", b.op("Mul", g, b.op("Mul", amax_b, b.const(np.float32(1 / 6)))), b.const(448.0)))
    zero = b.op("Equal", sf, b.const(0.0))
    enc = b.op("Where", zero, b.const(0.0), b.op("Div", b.const(1.0), b.op("Mul", sf, d)))
    q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), cfg.spec.element, cfg.rounding)
    return b.op("Mul", b.op("Mul", q, sf), d)


def _default_scale(b: Body, amax_b: str, g: str, inv: np.float32) -> str:
    """NVIDIA's block scale with the block amax mapped to 1/inv: e4m3(amax_b * (g * inv))."""
    s = b.op("Min", b.op("Mul", amax_b, b.op("Mul", g, b.const(inv))), b.const(FLT_MAX))
    return _e4m3(b, b.op("Max", b.op("Min", s, b.const(448.0)), b.const(-448.0)))


def _default_out(b: Body, x: str, s: str, d: str, cfg: QuantConfig) -> str:
    """The dequantized blocks under block scales s and decode scale d (NVIDIA's order)."""
    sd = b.op("Mul", s, d)
    enc = b.op("Min", b.op("Div", b.const(1.0), sd), b.const(FLT_MAX))
    q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), cfg.spec.element, cfg.rounding)
    return b.op("Mul", q, sd)


def _block_error(b: Body, out: str, x: str, axes: str, cfg: QuantConfig) -> str:
    """`nvfp4.block_error` along the block axis (kept, size 1): the terms zero-padded to the
    configured block (a power of two; a block cut to a shorter axis is shorter) and summed by
    halving with Slice and Add, so the fp32 additions are the reference's."""
    diff = b.op("Sub", out, x)
    t = b.op("Abs", diff) if cfg.four_over_six == "mae" else b.op("Mul", diff, diff)
    width = b.op("Gather", b.op("Shape", t), axes)
    pads = b.op("Concat", b.ints(0), b.op("Sub", b.ints(cfg.block), width), axis=0)
    t = b.op("Pad", t, pads, b.const(0.0), axes)
    h = cfg.block // 2
    while h >= 1:
        t = b.op("Add", b.op("Slice", t, b.ints(0), b.ints(h), axes),
                 b.op("Slice", t, b.ints(h), b.ints(2 * h), axes))
        h //= 2
    return t


def _modelopt_scale(b: Body, amax_b: str, amax_t: str | None, scale_t: str | None = None) -> str:
    """ModelOpt's block scale e4m3(clamp(amax_b / (6 d), 2^-9, 448)) * d, d = amax_t / 2688 or
    the stored `scale_t`."""
    d = b.op("Div", amax_t, b.const(2688.0)) if scale_t is None else scale_t
    d = b.op("Where", b.op("Or", b.op("Equal", d, b.const(0.0)), b.op("IsInf", d)), b.const(1.0), d)
    s = b.op("Div", amax_b, b.op("Mul", d, b.const(6.0)))
    s = b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(1.0), s)
    s = _e4m3(b, b.op("Max", b.op("Min", s, b.const(448.0)), b.const(2.0**-9)))
    return b.op("Mul", s, d)


def weight_scale(label: str, grid: torch.Tensor, tensor_scale: torch.Tensor | None,
                 cfg: QuantConfig) -> tuple[list[TensorProto], list[NodeProto]]:
    """compressed-tensors: one fp32 scale per block (block scale over the tensor scale); the
    others: E4M3 block scales and a DequantizeLinear by the fp32 decode scale."""
    if cfg.nvfp4_variant == "compressed-tensors":
        return [initializer(f"{label}/scale", (grid / tensor_scale).numpy().astype(np.float32))], []
    d = 1.0 if tensor_scale is None else float(tensor_scale)
    inits = [initializer(f"{label}/block_scale", grid.numpy().astype(ml_dtypes.float8_e4m3fn)),
             initializer(f"{label}/tensor_scale", np.array(d, np.float32))]
    node = helper.make_node("DequantizeLinear", [f"{label}/block_scale", f"{label}/tensor_scale"],
                            [f"{label}/scale"], name=f"{label}/scale_dequantize",
                            output_dtype=TensorProto.FLOAT)
    return inits, [node]


def _nvfp4_scale(b: Body, amax: str, variant: str) -> str:
    """Per-block NVFP4 scale in the variant's order (E4M3 block scale times the tensor scale)."""
    def e4m3(v: str) -> str:
        return _e4m3(b, b.op("Min", v, b.const(448.0)))

    if variant == "one_level":
        return e4m3(b.op("Div", amax, b.const(6.0)))
    amax_t = b.op("ReduceMax", amax, keepdims=0)
    if variant == "modelopt":
        return _modelopt_scale(b, amax, amax_t)
    if variant == "default":
        g = b.op("Min", b.op("Div", b.const(2688.0), amax_t), b.const(FLT_MAX))
        g = b.op("Where", b.op("Equal", g, b.const(0.0)), b.const(1.0), g)
        s = e4m3(b.op("Min", b.op("Mul", amax, b.op("Mul", g, b.const(np.float32(1 / 6)))), b.const(FLT_MAX)))
        return b.op("Mul", s, b.op("Div", b.const(1.0), g))
    g = b.op("Mul", b.op("Div", b.const(1.0), amax_t), b.const(2688.0))
    g = b.op("Where", b.op("Or", b.op("IsNaN", g), b.op("IsInf", g)), b.const(1.0), g)
    s = e4m3(b.op("Mul", g, b.op("Div", amax, b.const(6.0))))
    return b.op("Div", b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(0.125), s), g)


def activation_scale(b: Body, amax: str, cfg: QuantConfig) -> str:
    """The variant's block scale, raised to the smallest normal (zero blocks)."""
    if cfg.four_over_six != "none":
        raise UnsupportedExport("nvfp4 four_over_six chooses each block's scale from its "
                                "elements, not its amax: export with fake_quant_mode "
                                "'function' or 'inline'")
    return b.op("Max", _nvfp4_scale(b, amax, cfg.nvfp4_variant), b.const(2.0**-126))


register_onnx_family("nvfp4", OnnxFamily(nvfp4_blocks, weight_scale, activation_scale))
