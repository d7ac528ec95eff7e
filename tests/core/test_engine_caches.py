"""vLLM's per-token-head KV caches (`vllm/kv_int8_per_token_head`, `vllm/kv_fp8_per_token_head`)
against an independent port of what vLLM 0.32's Triton attention computes with them (written
from `_reshape_cache_per_token_head` and `kernel_unified_attention`, `USE_PER_TOKEN_HEAD_SCALES`):
the writer keeps codes and one fp32 scale per token and KV head; the reader takes the dot
product with the codes and multiplies the scales in after it (S = Q·codes · (softmax_scale ·
k_scale[token]), P·v_scale[token] in the values' dtype, then ·codes). qtransform multiplies the
scales into the cache's values first, so the two agree up to fp32 rounding, not bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.schemas.errors import PolicyError
from tests.helpers import register_attention, with_implementation

TILE = 32


def writer(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as fp32, scales [.., tokens, 1]) of one cache write, per token and head."""
    qmax = 127.0 if kind == "int8" else 448.0
    scale = torch.maximum(x.float().abs().amax(dim=-1, keepdim=True) / qmax, torch.tensor(1e-6))
    y = x.float() * (1.0 / scale)
    if kind == "int8":
        codes = torch.clamp(torch.where(y >= 0, y + 0.5, y - 0.5), -128, 127).to(torch.int8)
    else:
        codes = torch.clamp(y, -448, 448).to(torch.float8_e4m3fn)
    return codes.to(torch.float32), scale


def triton_reader(query, kc, ks, vc, vs, softmax_scale, causal_offset):
    """The Triton kernel's loop over tiles of 32 keys, scales applied after the products."""
    b, h, q_len, d = query.shape
    groups = h // kc.shape[1]
    kc, ks, vc, vs = (t.repeat_interleave(groups, dim=1) for t in (kc, ks, vc, vs))
    k_len = kc.shape[2]
    m = torch.full((b, h, q_len), -math.inf)
    rowsum = torch.ones(b, h, q_len)
    acc = torch.zeros(b, h, q_len, d)
    q = query.float()
    rows = torch.arange(q_len)[:, None] + causal_offset
    for start in range(0, k_len, TILE):
        cols = torch.arange(start, min(start + TILE, k_len))
        s = (q @ kc[:, :, cols].transpose(2, 3)) * (softmax_scale * ks[:, :, cols, 0][:, :, None, :])
        s = torch.where(cols[None, :] <= rows, s, -math.inf)
        m_j = torch.maximum(m, s.amax(-1))
        m_j = torch.where(m_j > -math.inf, m_j, 0.0)
        p = torch.exp(s - m_j[..., None])
        alpha = torch.exp(m - m_j)
        rowsum = rowsum * alpha + p.sum(-1)
        p_v = (p * vs[:, :, cols, 0][:, :, None, :]).to(query.dtype).float()
        acc = acc * alpha[..., None] + p_v @ vc[:, :, cols]
        m = m_j
    return (acc / rowsum[..., None]).transpose(1, 2).to(query.dtype)


def engine_reference(name: str, kind: str):
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        kc, ks = writer(key, kind)
        vc, vs = writer(value, kind)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return triton_reader(query, kc, ks, vc, vs, scale, key.shape[2] - query.shape[2]), None

    return register_attention(name, attention)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_per_token_head_caches_equal_the_engine_up_to_fp32_rounding(kind):
    model = build_tiny("qwen2", hidden=128)  # 4 query heads over 2 key/value heads
    ref = with_implementation(model, engine_reference(f"vllm-{kind}-per-token-head", kind))
    ours = qtransform.transform(model, {"preset": f"vllm/kv_{kind}_per_token_head"})
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))  # two key tiles
    with torch.no_grad():
        want, got, plain = ref(x).logits, ours(x).logits, model(x).logits
    gap = float((want - plain).abs().max())
    assert gap > 1e-4  # the cache moves the logits
    assert float((got - want).abs().max()) < 1e-3 * gap  # only fp32 rounding apart
    with torch.no_grad():  # generate: each step writes its token, reads the whole cache
        kwargs = {"max_new_tokens": 6, "do_sample": False}
        assert torch.equal(ours.generate(x[:1, :8], **kwargs), ref.generate(x[:1, :8], **kwargs))


def test_the_preset_writes_the_writer_and_the_triton_kernel():
    policy = qtransform.load_policy({"preset": "vllm/kv_int8_per_token_head"})
    rule = policy.quantize[0]
    assert (rule.format, rule.granularity, rule.int_range, rule.rounding, rule.scale_source) == (
        "int8", "token", "vllm-per-token-head", "rna", "dynamic")
    assert len(policy.quantize) == 1  # the query is not quantized
    assert (policy.engine.backend, policy.engine.kv_cache_dtype) == ("triton", "int8_per_token_head")


def test_a_backend_without_per_token_head_caches_is_refused_in_one_line():
    with pytest.raises(UserError) as exc:
        qtransform.load_policy({"preset": "vllm/kv_fp8_per_token_head", "preset_options": {"backend": "cpu"}})
    assert "\n" not in str(exc.value) and "triton" in str(exc.value)
    with pytest.raises(PolicyError) as exc:
        qtransform.load_policy({"engine": {"backend": "flash-attn-3", "kv_cache_dtype": "int8_per_token_head"}})
    assert "engine.kv_cache_dtype" in str(exc.value) and "Triton attention backend only" in str(exc.value)


@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_caches_write_what_the_kernel_writes(four_over_six):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tests.formats.test_kv_writers import nvfp4_writer

    def cache(x: torch.Tensor) -> torch.Tensor:  # every 16 values along head_dim, k_scale 1.0
        blocks = x.detach().float().numpy().reshape(-1, 16)
        out = np.stack([nvfp4_writer(b, 1.0, four_over_six) for b in blocks])
        return torch.from_numpy(out).reshape(x.shape).to(x.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, cache(key), cache(value), attention_mask, **kwargs)

    model = build_tiny("qwen2", hidden=128)
    ref = with_implementation(model, register_attention(f"vllm-nvfp4-{four_over_six}", attention))
    name = "vllm/kv_nvfp4_4over6" if four_over_six else "vllm/kv_nvfp4"
    ours = qtransform.transform(model, {"preset": name})
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want, got, plain = ref(x).logits, ours(x).logits, model(x).logits
    assert not torch.equal(want, plain)
    assert torch.equal(got, want)
