"""llm-compressor's SpinQuant R3 (the query and key after RoPE rotated online by a Hadamard along
head_dim, compressed-tensors' `q_attn` / `k_cache` transforms) against the rotate pass's point
`query_key`, with and without its FP8 KV cache, on the model SpinQuant leaves (its modifier
centers the embeddings and fuses the norms into the Linears even for R3 alone: that is the model
both sides rotate). Its online rotation runs in float64, ours in float32: equal to fp32 rounding,
not bit for bit. Its saved folder opens (`load_model` + `checkpoint_policy`) to the same logits,
and our export of the same policy is a folder compressed-tensors itself runs to ours.

Not here: R3 with llm-compressor's FP8 KV cache. compressed-tensors 0.19 cannot run the two
together on an attention module (its hooked attention then asks for a query scale, `q_scale`,
which a KV-only scheme never creates: AttributeError in the forward), so neither its oneshot
model nor a folder loaded with both is an oracle; tests/passes/test_rotate_attention.py checks
the FP8 KV cache after R3 against a reference attention function bit for bit."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests_llmc.oneshot import run_oneshot
from tests_llmc.test_presets import HIDDEN, samples

ct = pytest.importorskip("compressed_tensors.transform")

R3 = {"name": "R3", "kind": "hadamard", "point": "query_key"}
ATOL = 2e-5  # fp32 rounding of the rotation (theirs float64), through two layers


def spinquant(model, batches, tmp_path):
    """llm-compressor's SpinQuant modifier with R3 only: the model it leaves in memory."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.transform import SpinQuantModifier

    return run_oneshot(model, [SpinQuantModifier(rotations=["R3"], transform_type="hadamard")],
                       batches, tmp_path)


def left_by(theirs, model):
    """A plain copy of `model` holding the weights SpinQuant left (centered, norms fused)."""
    plain = copy.deepcopy(model)
    state = theirs.state_dict()
    plain.load_state_dict({k: state[k] for k in plain.state_dict()})
    return plain


def seen_by_attention(model, theirs: bool) -> dict[tuple[str, str], list[torch.Tensor]]:
    """Hooks recording, per attention module, the query and key its attention computes with:
    after llm-compressor's q_attn / k_cache hooks (`theirs`), or after our Rotate modules."""
    import inspect

    seen: dict[tuple[str, str], list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if not name.endswith("self_attn"):
            continue
        if theirs:
            for point, child, arg in (("query", module.impl, "query"), ("key", module.kv_cache, "key_states")):
                def hook(mod, args, kwargs, key=(name, point), arg=arg):
                    bound = inspect.signature(mod.forward).bind(*args, **kwargs)
                    seen.setdefault(key, []).append(bound.arguments[arg].detach().clone())
                child.register_forward_pre_hook(hook, with_kwargs=True)
        else:
            for point in ("query", "key"):
                def record(mod, args, out, key=(name, point)):
                    seen.setdefault(key, []).append(out.detach().clone())
                getattr(module, f"{point}_rotate").register_forward_hook(record)
    return seen


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_our_query_key_rotation_is_spinquant_r3_and_its_folder_opens(arch, tmp_path):
    model = build_tiny(arch, hidden=HIDDEN)
    batches, ids = samples(model.config.vocab_size)
    theirs = spinquant(model, batches, tmp_path / "cfg")
    ours = qtransform.transform(left_by(theirs, model), {"rotate": [R3]})
    expected_qk, got_qk = seen_by_attention(theirs, True), seen_by_attention(ours, False)
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(ids).logits
    assert sorted(got_qk) == sorted(expected_qk) and len(got_qk) == 2 * model.config.num_hidden_layers
    for key, tensors in expected_qk.items():  # the same rotated queries and keys, to fp32 rounding
        (want,), (have,) = tensors, got_qk[key]
        torch.testing.assert_close(have, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    theirs.save_pretrained(tmp_path / "theirs", save_compressed=True)
    groups = json.loads((tmp_path / "theirs" / "config.json").read_text())["quantization_config"][
        "transform_config"]["config_groups"]
    assert sorted(a["location"] for a in groups["R3"]["apply"]) == ["k_cache", "q_attn"]
    opened = qtransform.models.load_model(tmp_path / "theirs")
    policy = qtransform.checkpoint_policy(opened)
    assert [(r["name"], r["point"], r["block_size"]) for r in policy["rotate"]] == [("R3", "query_key", 16)]
    reopened = qtransform.transform(opened, policy)
    reopened_qk = seen_by_attention(reopened, False)
    with torch.no_grad():
        again = reopened(ids).logits
    assert all(torch.equal(reopened_qk[k][0], got_qk[k][0]) for k in got_qk)
    assert torch.equal(again, got)


def test_our_r3_export_runs_in_compressed_tensors_to_our_logits(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    build_tiny("qwen2", hidden=HIDDEN).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source").eval()
    batches, ids = samples(model.config.vocab_size)
    ours = qtransform.transform(model, {"preset": "llm-compressor/FP8_DYNAMIC", "rotate": [R3]})
    qtransform.export_checkpoint(ours, tmp_path / "export")
    config = ct.TransformConfig.model_validate(json.loads((tmp_path / "export" / "config.json").read_text())[
        "quantization_config"]["transform_config"])  # compressed-tensors' own schema
    ((name, group),) = config.config_groups.items()
    assert (group.type, group.head_dim) == ("hadamard", 16)
    assert sorted(a.location for a in group.apply) == ["k_cache", "q_attn"]
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:  # saved as llm-compressor saves it
        assert [k for k in f.keys() if name in k] == [f"model.layers.0.self_attn.{name}_q_attn.weight"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ct.apply_transform_config(loaded, config)
    rotated = seen_by_attention(loaded, True)
    got_qk = seen_by_attention(ours, False)
    with torch.no_grad():
        expected, got = ours(ids).logits, loaded(ids).logits
    assert len(rotated) == 4
    for key, (want,) in rotated.items():
        torch.testing.assert_close(got_qk[key][0], want, rtol=0, atol=1e-6 * float(want.abs().max()))
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
