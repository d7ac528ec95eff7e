"""The rotate pass at attention sites (point query_key, SpinQuant's R3): the query and the key
after RoPE rotated along head_dim, against reference attention functions registered in
transformers' AttentionInterface.

The reference rotates q and k with `formats.hadamard.fwht` and checks every rotated tensor
against an explicit H_b/√b (scipy's Sylvester matrix, float64) applied by hand, then
fake-quantizes with `formats.fake_quantize` and runs transformers' own sdpa function. In full
precision the rotated model must give the plain model's logits to fp32 rounding; with an FP8 KV
rule it must equal the reference bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import qtransform
from qtransform import formats
from qtransform.errors import UserError
from qtransform.formats import hadamard
from qtransform.models import build_tiny, tiny_config
from qtransform.passes import Rotate
from qtransform.schemas.errors import PolicyError
from qtransform.schemas.explain import explain
from tests.helpers import register_attention, with_implementation


def model_of(arch: str, head_dim: int = 16):
    """A tiny seeded model (build_tiny's config) with 4 query heads over 2 key/value heads of
    `head_dim`."""
    if head_dim == 16:
        return build_tiny(arch)
    import transformers

    config = tiny_config(arch, hidden=4 * head_dim)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, head_dim
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def ids(batch: int = 2, tokens: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def r3(block: int | None = None, **fields) -> dict:
    return {"kind": "hadamard", "point": "query_key", "block_size": block, **fields}


def kv(**fields) -> dict:
    return {"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "tensor", **fields}


def explicit(x: torch.Tensor, block: int) -> torch.Tensor:
    """x·H_b/√b per block of the last axis, in float64, from scipy's matrix."""
    h = torch.from_numpy(scipy.linalg.hadamard(block).astype(np.float64)) / np.sqrt(block)
    n = x.shape[-1]
    return (x.double().reshape(*x.shape[:-1], n // block, block) @ h).reshape(x.shape)


def rotated(x: torch.Tensor, block: int) -> torch.Tensor:
    """qtransform's fast Hadamard, checked here against the explicit matrix on this very tensor."""
    out = hadamard.fwht(x, block)
    exact = explicit(x, block)
    assert float((out.double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())
    return out


def reference(name: str, block: int, quantize: dict[str, dict], seen: dict | None = None) -> str:
    """Attention implementation `name`: q and k rotated per block of `block`, then the named
    tensors fake-quantized (`quantize`: point -> fake_quantize options; an `amax` option that is
    a dict is looked up per module), then transformers' sdpa. `seen` collects each module's
    largest |rotated key| and |value| (a static observer's amax)."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        tensors = {"query": rotated(query, block), "key": rotated(key, block), "value": value}
        if seen is not None:
            for point in ("key", "value"):
                amax = tensors[point].abs().max()
                seen[(module, point)] = torch.maximum(seen.get((module, point), amax), amax)
        for point, options in quantize.items():
            options = {k: v[(module, point)] if isinstance(v, dict) else v for k, v in options.items()}
            tensors[point] = formats.fake_quantize(tensors[point], **options)
        return sdpa_attention_forward(module, tensors["query"], tensors["key"], tensors["value"],
                                      attention_mask, **kwargs)

    return register_attention(name, attention)



@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize(("head_dim", "block"), [(64, None), (64, 16), (16, None)])
def test_full_precision_logits_and_generation_are_the_plain_models(arch, implementation, head_dim, block):
    model = model_of(arch, head_dim)
    model.set_attn_implementation(implementation)
    ours = qtransform.transform(model, {"rotate": [r3(block)]})
    rotations = [m for m in ours.modules() if isinstance(m, Rotate)]
    assert len(rotations) == 2 * model.config.num_hidden_layers
    assert {m.block for m in rotations} == {block or head_dim}
    x = ids()
    with torch.no_grad():
        plain, got = model(x).logits, ours(x).logits
    assert not torch.equal(got, plain)  # the rotation ran: fp32 rounding moved the last bits
    torch.testing.assert_close(got, plain, rtol=0, atol=1e-5)
    kwargs = {"max_new_tokens": 10, "do_sample": False}
    with torch.no_grad():
        assert torch.equal(ours.generate(x[:1, :5], **kwargs), model.generate(x[:1, :5], **kwargs))


@pytest.mark.parametrize(("arch", "head_dim", "block"), [("qwen2", 64, 64), ("llama", 64, 32), ("qwen2", 16, 16)])
@pytest.mark.parametrize("source", ["dynamic", "fixed"])
def test_fp8_keys_and_values_of_the_rotated_model_equal_the_reference_bit_for_bit(arch, head_dim, block, source):
    model = model_of(arch, head_dim)
    fields = {"scale_source": "fixed", "fixed_scale": 0.004} if source == "fixed" else {}
    options = {"fmt": "fp8_e4m3", "granularity": "tensor"}
    if source == "fixed":
        options["scale"] = torch.tensor(0.004)
    ref = with_implementation(model, reference(f"ref-r3-{arch}-{head_dim}-{block}-{source}", block,
                                               {"key": options, "value": options}))
    ours = qtransform.transform(model, {"rotate": [r3(block)], "quantize": [kv(**fields)]})
    unrotated = qtransform.transform(model, {"quantize": [kv(**fields)]})
    x = ids()
    with torch.no_grad():
        expected, got, other = ref(x).logits, ours(x).logits, unrotated(x).logits
    assert not torch.equal(got, other)
    assert torch.equal(got, expected)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad():
        a, b = ours.generate(x[:1, :6], **kwargs), ref.generate(x[:1, :6], **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(s, t) for s, t in zip(a.scores, b.scores, strict=True))


def test_a_static_kv_scale_is_calibrated_on_the_rotated_keys():
    model = model_of("qwen2", 64)
    g = torch.Generator().manual_seed(7)
    calib = [torch.randint(0, 256, (1, 16), generator=g) for _ in range(3)]
    seen: dict = {}  # (attention module, point) -> largest |x| over the calibration batches
    ref = with_implementation(model, reference("ref-r3-observe", 64, {}, seen))
    with torch.no_grad():
        for batch in calib:
            ref(batch)
    options = {"fmt": "fp8_e4m3", "granularity": "tensor", "amax": dict(seen)}
    ref.config._attn_implementation_internal = reference("ref-r3-static", 64, {"key": options, "value": options})
    ours = qtransform.transform(model, {"rotate": [r3()], "quantize": [kv(scale_source="static")]},
                                calibration=calib)
    unrotated = qtransform.transform(model, {"quantize": [kv(scale_source="static")]}, calibration=calib)
    x = ids()
    with torch.no_grad():
        expected, got, other = ref(x).logits, ours(x).logits, unrotated(x).logits
    assert not torch.equal(got, other)
    assert torch.equal(got, expected)


def test_random_hadamard_and_matrix_kinds_keep_q_kt(tmp_path):
    model = model_of("llama", 64)
    q, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    torch.save(q.float(), tmp_path / "r3.pt")
    x = ids()
    with torch.no_grad():
        plain = model(x).logits
        for rule in ({"kind": "random_hadamard", "seed": 5, "point": "query_key", "block_size": 32},
                     {"kind": "matrix", "matrix": str(tmp_path / "r3.pt"), "point": "query_key"}):
            got = qtransform.transform(model, {"rotate": [rule]})(x).logits
            torch.testing.assert_close(got, plain, rtol=0, atol=1e-5)


def test_plan_and_explain_show_the_query_and_key_rotations():
    model = model_of("qwen2", 64)
    policy = {"rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32},
                         {"name": "r3", "kind": "hadamard", "point": "query_key"}]}
    rows = [r for r in qtransform.plan(model, policy).rows if r.site.endswith("self_attn")]
    assert [(r.site, r.point, r.rule, r.detail) for r in rows] == [
        (f"model.layers.{i}.self_attn", p, "rotate[1] 'r3'", "hadamard block=64 along head_dim")
        for i in range(2) for p in ("query", "key")]
    text = explain(qtransform.load_policy(policy))
    assert "queries and keys of modules matching class Attention" in text
    assert "along head_dim, after RoPE" in text


@pytest.mark.parametrize(("rule", "words"), [
    ({"point": "query_key", "weight": "stored"}, r"rotate\[0\]\.weight: an attention's query and key have no weight"),
    ({"point": "query_key", "lora": "rotated"}, r"rotate\[0\]\.lora: LoRA adapters sit on Linears"),
    ({"point": "key"}, r"rotate\[0\]\.point: the query and the key are rotated together"),
    ({"tensors": ["query", "key"]}, r'rotate\[0\]\.tensors: .*"point": "query_key"'),
])
def test_policy_mistakes_name_the_field_and_the_fix(rule, words):
    with pytest.raises(PolicyError, match=words) as err:
        qtransform.load_policy({"rotate": [rule]})
    assert "\n" not in str(err.value)


def test_block_sizes_that_do_not_fit_head_dim_are_user_errors():
    model = model_of("qwen2", 64)
    with pytest.raises(UserError, match=r"rotate\[0\]\.block_size: 128 does not divide the 64 head_dim"):
        qtransform.plan(model, {"rotate": [r3(128)]})
    odd = model_of("qwen2", 24)
    with pytest.raises(UserError, match=r"null means the whole axis.*24 head_dim, not a power of two.*8"):
        qtransform.plan(odd, {"rotate": [r3()]})
    with pytest.raises(UserError, match="matches no attention site"):
        qtransform.plan(model, {"rotate": [r3(targets=["q_proj"])]})
