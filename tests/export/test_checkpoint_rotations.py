"""Rotations in a compressed-tensors checkpoint (docs/export.md, docs/rotations.md): the stored
weights are the rotated ones, W·R quantized, as the fake-quant model computes them; the online
input rotation is in `transform_config`; what compressed-tensors cannot express (and every
rotation in a ModelOpt checkpoint) is refused in one line before a file is written.
tests_llmc/test_checkpoint_rotations.py loads these folders with transformers and
compressed-tensors and compares them byte for byte with llm-compressor's QuIP."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import qtransform
from qtransform.core.lora import apply_chain, weight_chain
from qtransform.errors import UserError
from qtransform.models import build_tiny

HIDDEN = 128
LINEAR = {"targets": ["Linear"], "ignore": ["lm_head"]}
FP8_CHANNEL = {"preset": "llm-compressor/FP8_DYNAMIC"}


def _rotate(**rule) -> list[dict]:
    return [{**LINEAR, "block_size": 32, **rule}]


def _refused(arch: str, policy: dict, tmp_path, match: str, *, via_policy: bool = False, **kwargs) -> None:
    model = build_tiny(arch, hidden=HIDDEN)
    if not via_policy:
        model = qtransform.transform(model, policy)
    with pytest.raises(UserError, match=match) as info:
        qtransform.export_checkpoint(model, tmp_path / "out", policy=policy if via_policy else None, **kwargs)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("via_policy", [False, True])
def test_the_stored_weights_are_the_rotated_fake_quant_weights(via_policy, tmp_path):
    model = build_tiny("qwen2", hidden=HIDDEN, dtype=torch.bfloat16)
    policy = {**FP8_CHANNEL, "rotate": _rotate(name="h")}
    if via_policy:
        qtransform.export_checkpoint(model, tmp_path / "out", policy=policy)
        model = qtransform.transform(model, policy)
    else:
        model = qtransform.transform(model, policy)
        qtransform.export_checkpoint(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    group = config["transform_config"]["config_groups"]["h" if via_policy else "rotate_32"]
    assert group["type"] == "hadamard" and group["head_dim"] == 32
    assert [(a["location"], a["inverse"]) for a in group["apply"]] == [("input", False), ("weight_input", True)]
    names = group["apply"][0]["targets"]
    assert "model.layers.1.mlp.down_proj" in names and "lm_head" not in names
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        for name in names:
            site = model.get_submodule(name)
            expected = apply_chain(weight_chain(site), site.weight.detach())  # quant(W·R)
            decoded = f.get_tensor(f"{name}.weight").to(torch.float32) * f.get_tensor(f"{name}.weight_scale").float()
            assert torch.equal(decoded.to(torch.bfloat16), expected), name
            assert not torch.equal(expected, apply_chain(weight_chain(site)[1:], site.weight.detach()))
        key = f"{names[0]}.{'h' if via_policy else 'rotate_32'}_input.weight"
        h = f.get_tensor(key)  # the online transform's matrix, as llm-compressor saves it
        assert h.dtype == torch.float32 and torch.equal(h @ h.T, 32 * torch.eye(32))
        assert torch.equal(h.abs(), torch.ones(32, 32))


def test_a_rotated_linear_left_in_high_precision_is_stored_rotated(tmp_path):
    model = build_tiny("qwen2", hidden=HIDDEN)
    policy = {"rotate": _rotate(), "quantize": [{**LINEAR, "ignore": ["lm_head", "re:.*down_proj"],
                                                 "format": "fp8_e4m3", "granularity": "channel"}]}
    model = qtransform.transform(model, policy)
    qtransform.export_checkpoint(model, tmp_path / "out")
    site = model.get_submodule("model.layers.0.mlp.down_proj")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        stored = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert torch.equal(stored, site.weight_rotate.rotate_weight(site.weight.detach()))
    assert not torch.equal(stored, site.weight.detach())


@pytest.mark.parametrize("via_policy", [False, True])
def test_random_hadamard_is_refused(via_policy, tmp_path):
    _refused("qwen2", {**FP8_CHANNEL, "rotate": _rotate(kind="random_hadamard", seed=3)}, tmp_path,
             "random_hadamard.*Philox", via_policy=via_policy)


@pytest.mark.parametrize("via_policy", [False, True])
def test_a_matrix_rotation_is_refused(via_policy, tmp_path):
    torch.save(torch.eye(32), tmp_path.parent / f"{tmp_path.name}-r.pt")
    rule = {"kind": "matrix", "matrix": str(tmp_path.parent / f"{tmp_path.name}-r.pt")}
    _refused("qwen2", {**FP8_CHANNEL, "rotate": _rotate(**rule)}, tmp_path, "matrix", via_policy=via_policy)


def test_a_rotated_conv1d_is_refused(tmp_path):
    policy = {"rotate": [{"targets": ["Conv1D"], "block_size": 16}],
              "quantize": [{"targets": ["Conv1D"], "format": "fp8_e4m3", "granularity": "channel"}]}
    _refused("gpt2", policy, tmp_path, "is rotated but is not an nn.Linear \\(Conv1D\\)")


def test_rotated_experts_are_refused(tmp_path):
    policy = {"rotate": [{"targets": ["re:.*experts.*"], "block_size": 16}],
              "quantize": [{**LINEAR, "format": "fp8_e4m3", "granularity": "channel"}]}
    _refused("qwen2_moe", policy, tmp_path, "is rotated but is not an nn.Linear")


def test_modelopt_refuses_any_rotation(tmp_path):
    policy = {"rotate": _rotate(), "quantize": [{**LINEAR, "format": "fp8_e4m3"}]}
    _refused("qwen2", policy, tmp_path, "ModelOpt's hf_quant_config.json has no field for an online rotation",
             format="modelopt")


def test_a_rotated_tied_lm_head_is_refused(tmp_path):
    import transformers as tf

    from qtransform.models import tiny_config

    config = tiny_config("qwen2", hidden=HIDDEN)
    config.tie_word_embeddings = True
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    policy = {"rotate": [{"targets": ["Linear"], "block_size": 32}],
              "quantize": [{**LINEAR, "format": "fp8_e4m3", "granularity": "channel"}]}
    model = qtransform.transform(model, policy)
    with pytest.raises(UserError, match="lm_head is rotated but shares its weight.*tied embeddings"):
        qtransform.export_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
