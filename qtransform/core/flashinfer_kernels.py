"""FlashInfer's attention over vLLM's NVFP4 KV cache (`kv_cache_dtype` nvfp4, nvfp4_4over6).

Written from source, not run (vLLM 0.32.0's `v1/attention/backends/flashinfer.py` and
`utils/flashinfer.py`; FlashInfer 0.6.18, fb28d72). vLLM reads an NVFP4 cache with FlashInfer
only, and which kernel reads it depends on the GPU and the phase:

- `flashinfer` (FA2 template, `include/flashinfer/attention/prefill.cuh`; every call on compute
  capability 8.x and 9.x, prefill on 12.x): the query in the model's dtype; K~ = code · SF, exact
  in the model's dtype; S = q · K~ with fp32 accumulation; the softmax scale is fl(scale ·
  k_scale); p = exp2((S - m) · scale · k_scale · log2 e) in fp32, rounded to the model's dtype
  before P·V, and the row sum adds the rounded p; out = dtype(O / sum); then FlashInfer's wrapper
  multiplies that output by v_scale when it is not 1 (a second rounding).
- `flashinfer-xqa` (12.x): prefill as `flashinfer`, decode (one query token) by XQA
  (`csrc/xqa/mha.cu`, cache element 3): the logits fp32 times fl(scale · k_scale); per tile of
  64 keys p = exp(S - m) against the larger of the running max at the start of its 256-key
  block and the tile's own max, rounded to the model's dtype, the row sum of the rounded p; a
  tile whose max lies below the running max has its rounded p multiplied by dtype(exp(m_tile -
  m)) in the model's dtype; out = acc · (1 / sum · v_scale) in fp32; with head_dim 128 two warp
  groups each own alternate 32-key halves of every tile, and their normalised outputs are
  rounded to the model's dtype and added in it.
- `trtllm-gen` (10.x; closed cubins: only what vLLM and FlashInfer's launcher pass is read, the
  steps inside are inferred): the query quantized to E4M3 (q · fl(1 / q_scale), q_scale 1.0),
  keys and values converted to E4M3 (e4m3(code · SF)) for the FP8 matrix products, the logits
  times scale · k_scale, p rounded to E4M3 for P·V while the row sum takes the unrounded p, and
  the output written as E4M3 (e4m3(O / sum · v_scale)), then widened to the model's dtype.

The keys and values these functions receive are the quantize rules' decoded cache, code · SF ·
k_scale, so K~ = key / k_scale (exact in fp32 where the decoded value was; in a 16-bit model with
a k_scale other than a power of two the decoded value was rounded and K~ is within its ulp).
The GPUs' summation orders and their approximate exp2 and reciprocals are fp32 operations here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qtransform.core.attention_kernels import LOG2E, additive_mask, refuse_extras, rounded_e4m3
from qtransform.errors import UserError

XQA_BLOCK, XQA_TILE, XQA_HALF = 256, 64, 32  # keys per CTA block, per warp tile, per V sub-tile


def _rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` (E4M3: nearest even, saturating at 448) and back to fp32."""
    if dtype == torch.float8_e4m3fn:
        return rounded_e4m3(x)
    return x.to(dtype).to(torch.float32)


def _inputs(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
            options: dict[str, Any], kv_scales: tuple[float, float]) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float]:
    """fp32 q, K~ and V~ (the cache's code · SF, GQA heads repeated), the additive mask, and the
    softmax scale; refuses what FlashInfer does not run for an NVFP4 cache."""
    refuse_extras(module, options)
    if query.dtype not in (torch.bfloat16, torch.float16):
        raise UserError(f"FlashInfer reads an NVFP4 cache for bfloat16 and float16 models only, "
                        f"not {query.dtype}; load the model in bfloat16 (dtype=torch.bfloat16)")
    k_scale, v_scale = kv_scales
    groups = query.shape[1] // key.shape[1]
    k = (key.to(torch.float32) / k_scale).repeat_interleave(groups, dim=1)
    v = (value.to(torch.float32) / v_scale).repeat_interleave(groups, dim=1)
    scaling = options.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    mask = additive_mask(module, attention_mask, query.shape[2], key.shape[2], query.device)
    return query.to(torch.float32), k, v, mask, scale


def _f32(x: float) -> float:
    return float(np.float32(x))


def _logits(q: Tensor, k: Tensor, mask: Tensor | None, factor: float) -> Tensor:
    s = torch.matmul(q, k.transpose(2, 3)) * factor
    return s if mask is None else s + mask


def fa2(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
        options: dict[str, Any], fp8: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)
        ) -> tuple[Tensor, None]:
    """FlashInfer's FA2 template over an NVFP4 cache (module docstring), one key tile."""
    del fp8
    dtype = query.dtype
    q, k, v, mask, scale = _inputs(module, query, key, value, attention_mask, options, kv_scales)
    s = _logits(q, k, mask, 1.0)
    c = _f32(_f32(scale * kv_scales[0]) * LOG2E)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, 0.0, m)
    p = _rounded(torch.exp2(s * c - m * c), dtype)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, v) * torch.where(total > 0, 1.0 / total, 0.0)
    out = out.to(dtype)
    if kv_scales[1] != 1.0:  # the wrapper's `out *= v_scale` after the kernel
        out = (out.to(torch.float32) * kv_scales[1]).to(dtype)
    return out.transpose(1, 2).contiguous(), None


def xqa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
        options: dict[str, Any], fp8: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0)
        ) -> tuple[Tensor, None]:
    """vLLM on compute capability 12.x: XQA for a decode step (one query token), FA2 otherwise."""
    if query.shape[2] != 1:
        return fa2(module, query, key, value, attention_mask, options, fp8, kv_scales)
    dtype = query.dtype
    q, k, v, mask, scale = _inputs(module, query, key, value, attention_mask, options, kv_scales)
    head_dim = q.shape[-1]
    k_scale, v_scale = kv_scales
    # the host turns bmm1 = scale · k_scale into q_scale = bmm1 / v_scale · sqrt(D); the kernel
    # multiplies the accumulator by q_scale · v_scale · rsqrt(D)
    q_scale = _f32(_f32(scale * k_scale) / v_scale * math.sqrt(head_dim))
    s = _logits(q, k, mask, _f32(_f32(q_scale * _f32(v_scale)) * _f32(1.0 / math.sqrt(head_dim))))
    groups = 2 if head_dim == 128 else 1
    shape = s.shape[:-1]
    best = torch.full(shape, -math.inf)
    total = torch.zeros(shape)
    acc = torch.zeros(groups, *shape, v.shape[-1])
    k_len = s.shape[-1]
    for block in range(0, k_len, XQA_BLOCK):
        start_max = best.clone()
        for tile in range(block, min(block + XQA_BLOCK, k_len), XQA_TILE):
            st = s[..., tile:tile + XQA_TILE]
            m_t = torch.maximum(start_max, st.amax(dim=-1))
            m_safe = torch.where(m_t == -math.inf, 0.0, m_t)
            p = _rounded(torch.exp2(st * LOG2E - (m_safe * LOG2E)[..., None]), dtype)
            rowsum = p.sum(dim=-1)
            new = torch.maximum(best, m_t)
            new_safe = torch.where(new == -math.inf, 0.0, new)
            grow = torch.where(best == -math.inf, 0.0, torch.exp(best - new_safe))
            shrink = torch.where(m_t == -math.inf, 0.0, torch.exp(m_safe - new_safe))
            below = (m_t < new)[..., None]
            p = torch.where(below, _rounded(p * _rounded(shrink, dtype)[..., None], dtype), p)
            rowsum = torch.where(below[..., 0], rowsum * shrink, rowsum)
            total = total * grow + rowsum
            acc = acc * grow[..., None]
            best = new
            for half in range(tile, min(tile + XQA_TILE, k_len), XQA_HALF):
                g = ((half - tile) // XQA_HALF) % groups
                part = slice(half - tile, half - tile + XQA_HALF)
                acc[g] = acc[g] + torch.matmul(p[..., part], v[:, :, half:half + XQA_HALF])
    factor = torch.where(total > 0, 1.0 / total, 0.0) * _f32(v_scale)
    parts = (acc * factor[..., None]).to(dtype)
    out = parts[0]
    for g in range(1, groups):
        out = out + parts[g]  # in the model's dtype
    return out.transpose(1, 2).contiguous(), None


def trtllm_gen(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = False,
               kv_scales: tuple[float, float] = (1.0, 1.0)) -> tuple[Tensor, None]:
    """trtllm-gen's FMHA over an NVFP4 cache on compute capability 10.x (module docstring; the
    steps inside the closed kernel are inferred)."""
    del fp8
    dtype = query.dtype
    q, k, v, mask, scale = _inputs(module, query, key, value, attention_mask, options, kv_scales)
    q, k, v = (_rounded(t, torch.float8_e4m3fn) for t in (q, k, v))  # q_scale 1.0
    s = _logits(q, k, mask, _f32(scale * kv_scales[0]))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(m == -math.inf, 0.0, m))
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(_rounded(p, torch.float8_e4m3fn), v) * torch.where(total > 0, 1.0 / total, 0.0)
    out = _rounded(out * _f32(kv_scales[1]), torch.float8_e4m3fn)
    return out.to(dtype).transpose(1, 2).contiguous(), None


KERNELS = {"flashinfer": fa2, "flashinfer-xqa": xqa, "trtllm-gen": trtllm_gen}
