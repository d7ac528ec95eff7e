"""An independent model of what llm-compressor 0.14 / compressed-tensors 0.19 compute for their preset
schemes, in plain torch (no qtransform code): the main suite's reference for the llm-compressor
presets. tests_llmc/test_reference.py checks it against llm-compressor itself (logits equal for
every scheme, Qwen2 and Llama, fp32 and bf16), so a main-suite test against it is a test against
llm-compressor. The formulas and their sources are in docs/recipes.md.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SCHEMES = ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W8A8")
FUSED = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"))
E2M1_STEPS = ((0.25, 0.5, False), (0.75, 1.0, True), (1.25, 1.5, False), (1.75, 2.0, True),
              (2.5, 3.0, False), (3.5, 4.0, True), (5.0, 6.0, False))


def fp4(y: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' cast_to_fp4: thresholds on |y| (ties to even), the sign put back."""
    a = y.abs()
    out = torch.zeros_like(a)
    for edge, value, inclusive in E2M1_STEPS:
        out = torch.where(a >= edge if inclusive else a > edge, torch.full_like(a, value), out)
    return out * torch.sign(y)


def qdq(x: torch.Tensor, scale: torch.Tensor, kind: str, global_scale=None) -> torch.Tensor:
    """_quantize_dequantize: divide by the scale, clamp, round to the grid, multiply back."""
    if global_scale is not None:
        scale = scale / global_scale
    y = x / scale
    if kind == "fp4":
        q = fp4(y.clamp(-6, 6))
    elif kind == "fp8":
        q = y.clamp(-448, 448).to(torch.float8_e4m3fn).to(y.dtype)
    else:
        lo, hi = {"int4": (-8, 7), "int8": (-128, 127)}[kind]
        q = torch.round(y.clamp(lo, hi))
    return q.to(scale.dtype) * scale


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale.dtype).eps), scale)


def groups(x: torch.Tensor, size: int, fn) -> torch.Tensor:
    return fn(x.unflatten(-1, (-1, size))).flatten(-2).to(x.dtype)


def amax(x: torch.Tensor, dim=-1) -> torch.Tensor:
    return x.abs().amax(dim, keepdim=True)


def global_scale(a: torch.Tensor) -> torch.Tensor:
    """generate_gparam: 448 * 6 / amax in the amax's dtype, inf/nan -> 1, an fp32 tensor of shape (1,)."""
    g = 2688.0 / a.clamp(min=torch.finfo(a.dtype).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).float().reshape(1)


def nvfp4(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    def block(xs):
        s = g * (amax(xs) / 6)
        s = s.clamp(-448, 448).to(torch.float8_e4m3fn).to(s.dtype)
        s = torch.where(s == 0, torch.full_like(s, 0.125), s).to(x.dtype)  # stored in the model dtype
        return qdq(xs, s, "fp4", g)
    return groups(x, 16, block)


def mx_scale(a: torch.Tensor) -> torch.Tensor:
    """generate_mx_scales: round the amax up to the next power of two from 1.75 * 2^e, minus 2."""
    if a.dtype == torch.float32:
        bits, mantissa = a.view(torch.int32), 23
    else:
        bits, mantissa = a.view(torch.int16).to(torch.int32) & 0xFFFF, 7
    mask = ((1 << 9) - 1) << mantissa
    p = (bits + (1 << (mantissa - 2))) & mask
    p = p.view(torch.float32) if a.dtype == torch.float32 else p.to(torch.int16).view(torch.bfloat16)
    code = (127 + torch.floor(torch.log2(p)) - 2).clamp(0, 255).round()
    return (2.0 ** (code - 127).float()).to(a.dtype)


def mxfp4(x: torch.Tensor) -> torch.Tensor:
    return groups(x, 32, lambda xs: qdq(xs, mx_scale(amax(xs)), "fp4"))


def fp8_tiles(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    p = F.pad(w, (0, -cols % 128, 0, -rows % 128))
    t = p.reshape(p.shape[0] // 128, 128, p.shape[1] // 128, 128).transpose(1, 2)
    q = qdq(t, nonzero(amax(t, (-1, -2)) / 448), "fp8")
    return q.transpose(1, 2).reshape(p.shape)[:rows, :cols]


def quantized_weight(scheme: str, w: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    if scheme.startswith("NVFP4"):
        return nvfp4(w, g)
    if scheme.startswith("MXFP4"):
        return mxfp4(w)
    if scheme == "FP8":
        return qdq(w, nonzero(w.abs().max() / 448), "fp8")
    if scheme == "FP8_DYNAMIC":
        return qdq(w, nonzero(amax(w) / 448), "fp8")
    if scheme == "FP8_BLOCK":
        return fp8_tiles(w)
    if scheme == "W4A16":
        return groups(w, 128, lambda ws: qdq(ws, nonzero(amax(ws) / 7.5), "int4"))
    return qdq(w, nonzero(amax(w) / 127.5), "int8")  # W8A8


def input_quantizer(scheme: str, static_amax: torch.Tensor | None):
    """The input QDQ of a Linear, or None for weight-only schemes."""
    if scheme == "NVFP4":
        g = global_scale(static_amax)
        return lambda x: nvfp4(x, g)
    if scheme == "MXFP4":
        return mxfp4
    if scheme == "FP8":
        s = nonzero(static_amax / 448).reshape(1)
        return lambda x: qdq(x, s, "fp8")
    if scheme == "FP8_DYNAMIC":
        return lambda x: qdq(x, nonzero(amax(x) / 448), "fp8")
    if scheme == "FP8_BLOCK":
        return lambda x: groups(x, 128, lambda xs: qdq(xs, nonzero(amax(xs) / 448), "fp8"))
    if scheme == "W8A8":
        return lambda x: qdq(x, nonzero(amax(x) / 127.5), "int8")
    return None


def calibrated_amax(model: nn.Module, names: list[str], batches) -> dict[str, torch.Tensor]:
    """The max |input| of each Linear over every calibration token, from the full-precision model
    run with eager attention (llm-compressor's calibration_forward_context)."""
    found: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            a = args[0].abs().amax()
            found[name] = torch.maximum(found[name], a) if name in found else a
        return record

    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        model.config._attn_implementation = attention
        for h in handles:
            h.remove()
    return found


def reference_model(model: nn.Module, scheme: str, batches) -> nn.Module:
    """A copy of `model` computing what llm-compressor's oneshot(scheme, ignore=["lm_head"]) computes:
    quantized weights written into the copy, input QDQ as forward pre-hooks."""
    model = copy.deepcopy(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    static = calibrated_amax(model, list(linears), batches) if scheme in ("NVFP4", "FP8") else {}
    fused: dict[str, torch.Tensor] = {}
    for parent_name, parent in model.named_modules():
        for group in FUSED:
            if all(hasattr(parent, leaf) for leaf in group):
                a = torch.stack([getattr(parent, leaf).weight.abs().max() for leaf in group]).max()
                fused.update({f"{parent_name}.{leaf}": global_scale(a) for leaf in group})
    for name, linear in linears.items():
        w = linear.weight.data
        g = fused.get(name, global_scale(w.abs().max())) if scheme.startswith("NVFP4") else None
        linear.weight.data = quantized_weight(scheme, w, g)
        act = input_quantizer(scheme, static.get(name))
        if act is not None:
            linear.register_forward_pre_hook(lambda module, args, act=act: (act(args[0]),))
    return model
