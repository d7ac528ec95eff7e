"""A rotated export (the rotate pass's hadamard in compressed-tensors' `transform_config`) loaded
with the real libraries: transformers with compressed-tensors decompresses the weights, which
hold W·R already (the `weight_input` transform is fused at save, as llm-compressor's QuIP
modifier leaves it), and applies no transform itself (its quantizer never reads
`transform_config`); the engine's part is the online `input` rotation, applied here with
compressed-tensors' own `apply_transform_config` restricted to the online locations, as vLLM's
transform layers do. The result is the fake-quant model's logits (docs/export.md)."""

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


def online_only(folder) -> ct.TransformConfig:
    """The checkpoint's transform_config with only the locations an engine runs (the fused
    `weight_input` is in the stored weights already)."""
    data = json.loads((folder / "config.json").read_text())["quantization_config"]["transform_config"]
    for group in data["config_groups"].values():
        group["apply"] = [a for a in group["apply"] if a["location"] == "input"]
    return ct.TransformConfig.model_validate(data)


@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "W4A16", "FP8_DYNAMIC", "NVFP4"])
def test_a_rotated_export_loads_into_the_fake_quant_logits(scheme, block, tmp_path):
    from transformers import AutoModelForCausalLM

    build_tiny("qwen2", hidden=HIDDEN).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16).eval()
    batches, ids = samples(model.config.vocab_size)
    policy = {"preset": f"llm-compressor/{scheme}",
              "rotate": [{"name": "h", "targets": ["Linear"], "ignore": ["lm_head"], "block_size": block}]}
    ours = qtransform.transform(model, policy, calibration=batches)
    qtransform.export_checkpoint(ours, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        unrotated = loaded(ids).logits
        ct.apply_transform_config(loaded, online_only(tmp_path / "export"))
        expected, got = ours(ids).logits, loaded(ids).logits
    assert not torch.equal(unrotated, expected)  # the online rotation is needed
    assert torch.equal(got, expected), f"max |diff| {(got - expected).float().abs().max().item():.3g}"


def quip_model(model, scheme: str, block: int, batches, tmp_path):
    """llm-compressor's QuIP modifier (input rotations "v", kind hadamard) then its preset."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import QuIPModifier

    recipe = [QuIPModifier(rotations=["v"], transform_type="hadamard", transform_block_size=block,
                           ignore=["lm_head"]),
              QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])]
    return run_oneshot(model, recipe, batches, tmp_path)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16", "W4A16", "FP8_DYNAMIC"])
def test_rotated_export_matches_llm_compressor_quip(scheme, tmp_path):
    from tests_llmc.test_checkpoint import raw, tensors

    model = build_tiny("qwen2", hidden=HIDDEN, dtype=torch.bfloat16)
    batches, _ = samples(model.config.vocab_size)
    quip_model(model, scheme, 32, batches, tmp_path / "cfg").save_pretrained(tmp_path / "theirs", save_compressed=True)
    policy = {"preset": f"llm-compressor/{scheme}",
              "rotate": [{"name": "v", "targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32}]}
    qtransform.export_checkpoint(copy.deepcopy(model), tmp_path / "ours", policy=policy, calibration=batches)
    expected, got = tensors(tmp_path / "theirs"), tensors(tmp_path / "ours")
    assert sorted(got) == sorted(expected)
    bad = [n for n in expected if n in got and not torch.equal(raw(got[n].to(expected[n].dtype)), raw(expected[n]))]
    assert not bad, bad


@pytest.mark.parametrize("scheme", ["NVFP4A16", "W4A16", "FP8_DYNAMIC", "NVFP4"])
def test_a_quip_checkpoint_opened_by_qtransform_gives_the_engine_logits(scheme, tmp_path):
    """llm-compressor's own QuIP folder (hadamard "v" rotations in float64, its default
    precision) opened by `load_model` and transformed with `checkpoint_policy`: the logits
    transformers with compressed-tensors gives for the folder with the online transforms on."""
    from transformers import AutoModelForCausalLM

    from qtransform.models import checkpoint_policy, load_model

    model = build_tiny("qwen2", hidden=HIDDEN, dtype=torch.bfloat16)
    batches, ids = samples(model.config.vocab_size)
    quip_model(model, scheme, 32, batches, tmp_path / "cfg").save_pretrained(tmp_path / "theirs", save_compressed=True)
    config = json.loads((tmp_path / "theirs" / "config.json").read_text())["quantization_config"]
    [group] = config["transform_config"]["config_groups"].values()
    assert group["type"] == "hadamard" and group["head_dim"] == 32
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16).eval()
    ct.apply_transform_config(loaded, online_only(tmp_path / "theirs"))
    opened = load_model(tmp_path / "theirs")
    policy = checkpoint_policy(opened)
    [rule] = policy["rotate"]
    assert (rule["weight"], rule["block_size"], len(rule["targets"])) == ("stored", 32, 14)
    with torch.no_grad():
        expected = loaded(ids).logits
        got = qtransform.transform(opened, policy)(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).float().abs().max().item():.3g}"
