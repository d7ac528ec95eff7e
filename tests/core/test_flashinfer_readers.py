"""FlashInfer's readers of vLLM's NVFP4 KV cache (`core/flashinfer_kernels.py`) against a
teammate's independent port of the same sources (`tests/core/flashinfer_reference.py`: other
layout, codes and block scales as inputs), and the rounding steps that set them apart from
attention on the decoded cache."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qtransform
from qtransform.core import flashinfer_kernels
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.schemas.errors import PolicyError
from tests.core import flashinfer_reference as ref

READERS = {"flashinfer": ("fa2", flashinfer_kernels.fa2), "flashinfer-xqa": ("xqa", flashinfer_kernels.xqa),
           "trtllm-gen": ("trtllm_gen", flashinfer_kernels.trtllm_gen)}


class Causal(nn.Module):
    is_causal = True


def cache(seed: int, tokens: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes [T, H, D] and E4M3 block scales [T, H, D / 16]."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (tokens, heads, dim), generator=g)
    sf = (torch.rand(tokens, heads, dim // 16, generator=g) * 3 + 0.1).to(torch.float8_e4m3fn).float()
    return codes, sf


def ours(backend: str, q: torch.Tensor, kc, ksf, k_scale, vc, vsf, v_scale) -> torch.Tensor:
    """Our reader on the quantize rules' decoded cache ([B, H, T, D] layout), as [Tq, H, D]."""
    key = ref.decode_cache(kc, ksf, k_scale).transpose(0, 1)[None].to(q.dtype)
    value = ref.decode_cache(vc, vsf, v_scale).transpose(0, 1)[None].to(q.dtype)
    out, _ = READERS[backend][1](Causal(), q.transpose(0, 1)[None], key, value, None, {},
                                 kv_scales=(k_scale, v_scale))
    return out[0].float()


def ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|a - b| in units of the model dtype's spacing at b."""
    spacing = torch.finfo(dtype).eps * b.abs().clamp_min(torch.finfo(dtype).tiny)
    return (a - b).abs() / spacing


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), backend=st.sampled_from(sorted(READERS)),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]), dim=st.sampled_from([64, 128]),
       tokens=st.integers(1, 300), scales=st.sampled_from([(1.0, 1.0), (0.5, 2.0), (0.25, 0.125)]))
def test_each_reader_equals_the_independent_port(seed, backend, dtype, dim, tokens, scales):
    """Within one unit of the model's dtype (the two sum their fp32 products in other orders),
    and exactly equal almost everywhere; decode steps for XQA, prefill rows for the others."""
    k_scale, v_scale = scales
    kc, ksf = cache(seed, tokens, 2, dim)
    vc, vsf = cache(seed + 1, tokens, 2, dim)
    q_len = 1 if backend == "flashinfer-xqa" else min(tokens, 7)
    q = torch.randn(q_len, 4, dim, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    name = READERS[backend][0]
    want = ref.READERS[name](q, kc, ksf, k_scale, vc, vsf, v_scale, model_dtype=dtype) if name != "trtllm_gen" \
        else ref.trtllm_gen_reader(q, kc, ksf, k_scale, vc, vsf, v_scale)
    got = ours(backend, q, kc, ksf, k_scale, vc, vsf, v_scale)
    unit = torch.float8_e4m3fn if backend == "trtllm-gen" else dtype
    assert float(ulps(got, want.float(), unit if unit != torch.float8_e4m3fn else torch.bfloat16).max()) <= (
        32 if unit == torch.float8_e4m3fn else 1.01)
    assert float((got == want.float()).float().mean()) >= 0.97


@pytest.mark.parametrize("backend", sorted(READERS))
def test_the_kernels_roundings_show(backend):
    """On the same cache, each reader is far closer to the port with its roundings than to
    attention on the decoded cache (the port with every rounding off)."""
    kc, ksf = cache(3, 200, 2, 128)
    vc, vsf = cache(4, 200, 2, 128)
    q_len = 1 if backend == "flashinfer-xqa" else 8
    q = torch.randn(q_len, 4, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    name = READERS[backend][0]
    args = (q, kc, ksf, 0.5, vc, vsf, 2.0)
    rounded, exact = ref.READERS[name](*args), ref.READERS[name](*args, exact=True)
    got = ours(backend, *args)
    assert float((got - rounded.float()).abs().mean()) * 20 < float((got - exact.float()).abs().mean())


def test_fa2_normalises_by_the_rounded_probabilities_and_rounds_twice_with_v_scale():
    """Two keys whose second probability rounds in the model's dtype: the row sum adds the
    rounded one; the wrapper's v_scale multiplies the already rounded output."""
    dim = 16
    key = torch.zeros(1, 1, 2, dim, dtype=torch.float16)
    key[0, 0, 1, 0] = 1.0
    value = torch.zeros(1, 1, 2, dim, dtype=torch.float16)
    value[0, 0, 0, 0] = 1.0
    query = torch.zeros(1, 1, 1, dim, dtype=torch.float16)
    query[0, 0, 0, 0] = -0.875
    out, _ = flashinfer_kernels.fa2(Causal(), query, key, value, None, {}, kv_scales=(1.0, 1.0))
    c = float(torch.tensor(0.25 * 1.4426950408889634, dtype=torch.float32))
    p1 = torch.exp2(torch.tensor(-0.875 * c))
    rounded = p1.to(torch.float16).float()
    assert (1.0 / (1.0 + rounded)).to(torch.float16) != (1.0 / (1.0 + p1)).to(torch.float16)
    assert out[0, 0, 0, 0] == (1.0 / (1.0 + rounded)).to(torch.float16)
    scaled, _ = flashinfer_kernels.fa2(Causal(), query, key * 1, value * 3, None, {}, kv_scales=(1.0, 3.0))
    assert scaled[0, 0, 0, 0] == (out[0, 0, 0, 0].float() * 3.0).to(torch.float16)


def tiny_bf16() -> nn.Module:
    return build_tiny("llama", hidden=128).to(torch.bfloat16)


@pytest.mark.parametrize("backend", sorted(READERS))
def test_the_presets_backend_reads_the_cache_with_flashinfer(backend):
    """The preset's engine section runs the reader on the rule's cache: its logits differ from
    the model's own attention on the same cache by the kernel's rounding only."""
    model = tiny_bf16()
    x = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    name = "vllm/kv_nvfp4_4over6" if backend == "trtllm-gen" else "vllm/kv_nvfp4"
    read = qtransform.transform(model, {"preset": name, "preset_options": {"backend": backend}})
    decoded = qtransform.transform(model, {"preset": name, "preset_options": {"backend": "none"}})
    assert read.config._attn_implementation.startswith("qtransform_")
    with torch.no_grad():
        a, b, plain = read(x).logits.float(), decoded(x).logits.float(), model(x).logits.float()
    assert torch.isfinite(a).all()
    assert 0 < float((a - b).abs().max()) < float((b - plain).abs().max()) * (3 if backend == "trtllm-gen" else 1)


def test_refusals_are_one_line():
    with pytest.raises(UserError) as exc:
        qtransform.load_policy({"preset": "vllm/kv_nvfp4_4over6", "preset_options": {"backend": "flashinfer"}})
    assert "\n" not in str(exc.value) and "trtllm-gen" in str(exc.value)
    with pytest.raises(PolicyError) as exc:
        qtransform.load_policy({"engine": {"backend": "cpu", "kv_cache_dtype": "nvfp4"}})
    assert "engine.kv_cache_dtype" in str(exc.value) and "FlashInfer only" in str(exc.value)
    with pytest.raises(PolicyError) as exc:
        qtransform.load_policy({"engine": {"backend": "flashinfer", "kv_cache_dtype": "fp8"}})
    assert "NVFP4 caches only" in str(exc.value)
    fp32 = build_tiny("llama", hidden=128)
    policy = {"preset": "vllm/kv_nvfp4", "preset_options": {"backend": "flashinfer"}}
    with pytest.raises(UserError) as exc, torch.no_grad():
        qtransform.transform(fp32, policy)(torch.zeros(1, 4, dtype=torch.long))
    assert "\n" not in str(exc.value) and "bfloat16" in str(exc.value)
    auto = {"engine": {"backend": "auto", "kv_cache_dtype": "nvfp4"},
            "quantize": [{"targets": ["Attention"], "tensors": ["key", "value"], "format": "nvfp4",
                          "nvfp4_variant": "vllm-kv", "scale_source": "fixed", "fixed_scale": 1.0}]}
    with pytest.raises(UserError) as exc:
        qtransform.transform(tiny_bf16(), auto)
    assert "\n" not in str(exc.value) and "GPUs only" in str(exc.value)
