"""Attention sites: query, key, value and probabilities reached through transformers' attention
interface, checked against an attention function written here from transformers' own
(`sdpa_attention_forward` / the eager formula) with `formats.fake_quantize` on its tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import qtransform
from qtransform import formats
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.schemas.errors import PolicyError
from tests.helpers import register_attention, with_implementation

ARCHS = ["qwen2", "llama", "mistral", "gpt2", "mixtral", "qwen3_moe"]


def ids(vocab: int = 256, batch: int = 2, tokens: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def kv_rule(**fields) -> dict:
    return {"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "tensor",
                          **fields}]}


def reference(name: str, quantize: dict[str, dict]):
    """An attention implementation `name` that fake-quantizes the named tensors of every
    attention (`quantize`: point -> fake_quantize options), then runs sdpa."""
    def attention(module, query, key, value, attention_mask, **kwargs):
        tensors = {"query": query, "key": key, "value": value}
        for point, options in quantize.items():
            tensors[point] = formats.fake_quantize(tensors[point], **options)
        return sdpa_attention_forward(module, tensors["query"], tensors["key"], tensors["value"],
                                      attention_mask, **kwargs)

    return register_attention(name, attention)



@pytest.mark.parametrize("arch", ARCHS)
def test_every_attention_module_is_a_site_with_its_heads(arch):
    model = build_tiny(arch)
    sites = [s for s in qtransform.capture(model).sites.values() if s.kind == "attention"]
    config = model.config
    assert [s.name for s in sites] == [n for n, m in model.named_modules()
                                       if type(m).__name__.endswith("Attention")]
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    assert {s.heads for s in sites} == {(heads, kv, config.hidden_size // heads)}
    assert {s.role for s in sites} == {"attention"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_switched_off_attention_quantizers_give_the_original_outputs_bit_for_bit(arch, implementation):
    model = build_tiny(arch)
    model.set_attn_implementation(implementation)
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
    policy = {"quantize": [{"format": "fp8_e4m3", "tensors": ["query", "key", "value", "probs"],
                            "granularity": "token"}]}
    transformed = qtransform.transform(model, policy)
    assert model.config._attn_implementation == implementation  # the user's model is untouched
    for module in transformed.modules():
        if isinstance(module, qtransform.passes.FakeQuantize):
            module.enabled = False
    with torch.no_grad():
        got = transformed(x).logits
    if implementation == "eager":  # the probs point computes eager attention as transformers does
        assert torch.equal(got, expected)
    else:  # the probs point computes it eagerly, where the model ran sdpa
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        untouched = qtransform.transform(model, kv_rule(layers="0"))
        for module in untouched.modules():
            if isinstance(module, qtransform.passes.FakeQuantize):
                module.enabled = False
        assert torch.equal(untouched(x).logits, expected)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "mixtral"])
@pytest.mark.parametrize(("granularity", "fields"), [("tensor", {}), ("token", {}),
                                                     ("block", {"block_size": 8})])
def test_key_value_quantization_equals_quantizing_the_attention_call_tensors(arch, granularity, fields):
    model = build_tiny(arch)
    if arch == "mistral":
        model.config.sliding_window = 5  # keys beyond the window are masked
    options = {"fmt": "fp8_e4m3", "granularity": granularity, **fields}
    ref = with_implementation(model, reference(f"ref-kv-{granularity}", {"key": options, "value": options}))
    transformed = qtransform.transform(model, kv_rule(granularity=granularity, **fields))
    x = ids()
    with torch.no_grad():
        expected, got, plain = ref(x).logits, transformed(x).logits, model(x).logits
    assert not torch.equal(expected, plain)
    assert torch.equal(got, expected)


def test_generate_quantizes_every_cached_token_and_the_current_one():
    model = build_tiny("qwen2")
    options = {"fmt": "fp8_e5m2", "granularity": "token"}
    ref = with_implementation(model, reference("ref-kv-generate", {"key": options, "value": options}))
    transformed = qtransform.transform(model, {"quantize": [
        {"format": "fp8_e5m2", "tensors": ["key", "value"], "granularity": "token"}]})
    prompt = ids(batch=1, tokens=6)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        expected, got = ref.generate(prompt, **kwargs), transformed.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores, strict=True):
        assert torch.equal(a, b)


def test_query_and_one_scale_per_head_equal_the_reference():
    model = build_tiny("qwen2", hidden=128)  # 4 query heads over 2 key/value heads
    heads = model.config.num_key_value_heads

    def per_head(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([formats.fake_quantize(x[:, h:h + 1], "fp8_e4m3", granularity="tensor")
                          for h in range(x.shape[1])], dim=1)

    def attention(module, query, key, value, attention_mask, **kwargs):
        assert key.shape[1] == heads
        query = formats.fake_quantize(query, "fp8_e4m3", granularity="tensor")
        return sdpa_attention_forward(module, query, per_head(key), value, attention_mask, **kwargs)

    ref = with_implementation(model, register_attention("ref-head", attention))
    transformed = qtransform.transform(model, {"quantize": [
        {"format": "fp8_e4m3", "tensors": ["key"], "granularity": "head"},
        {"format": "fp8_e4m3", "tensors": ["query"], "granularity": "tensor"}]})
    x = ids()
    with torch.no_grad():
        assert torch.equal(transformed(x).logits, ref(x).logits)


@settings(max_examples=12, deadline=None)
@given(scale=st.floats(min_value=2.0 ** -8, max_value=2.0 ** 4), fmt=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]))
def test_a_fixed_scale_divides_and_saturates_like_the_engines_cast(scale, fmt):
    model = build_tiny("llama")
    options = {"fmt": fmt, "granularity": "tensor", "scale": torch.tensor(scale)}
    ref = with_implementation(model, reference(f"ref-fixed-{fmt}-{scale}", {"key": options, "value": options}))
    transformed = qtransform.transform(model, {"quantize": [
        {"format": fmt, "tensors": ["key", "value"], "granularity": "tensor", "scale_source": "fixed",
         "fixed_scale": scale}]})
    x = ids()
    with torch.no_grad():
        assert torch.equal(transformed(x).logits, ref(x).logits)


def test_probs_are_quantized_before_their_product_with_v():
    model = build_tiny("llama")
    model.set_attn_implementation("eager")

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = module.num_key_value_groups
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probs = formats.fake_quantize(probs, "fp8_e4m3", granularity="token")
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    ref = with_implementation(model, register_attention("ref-probs", attention, mask="eager"))
    transformed = qtransform.transform(model, {"quantize": [
        {"format": "fp8_e4m3", "tensors": ["probs"], "granularity": "token"}]})
    x = ids()
    with torch.no_grad():
        assert torch.equal(transformed(x).logits, ref(x).logits)


def test_plan_lists_the_attention_points():
    rows = qtransform.plan(build_tiny("qwen2"), kv_rule()).rows
    assert [(r.site, r.point) for r in rows] == [
        (f"model.layers.{i}.self_attn", p) for i in range(2) for p in ("key", "value")]


@pytest.mark.parametrize(("rule", "words"), [
    ({"format": "fp8_e4m3", "tensors": ["weight", "key"]}, "mixes a Linear's tensors"),
    ({"format": "fp8_e4m3", "tensors": ["weight"], "granularity": "head"}, "one scale per head is for attention"),
    ({"format": "fp8_e4m3", "tensors": ["key"], "granularity": "tensor", "scale_source": "fixed"},
     'scale_source "fixed" needs the scale'),
    ({"format": "fp8_e4m3", "tensors": ["key"], "fixed_scale": 1.0}, 'only used with scale_source "fixed"'),
])
def test_policy_mistakes_on_attention_tensors_name_the_field(rule, words):
    with pytest.raises(PolicyError, match=words):
        qtransform.load_policy({"quantize": [rule]})


def test_attention_rule_selects_attention_modules_only():
    model = build_tiny("qwen2")
    with pytest.raises(UserError, match="matches no attention site"):
        qtransform.plan(model, {"quantize": [{"format": "fp8_e4m3", "tensors": ["key"],
                                              "targets": ["q_proj"]}]})
    with pytest.raises(UserError, match="module mode"):
        qtransform.transform(model, kv_rule(), {"input_ids": ids()}, mode="graph")
