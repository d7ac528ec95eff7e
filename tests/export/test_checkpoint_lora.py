"""A PEFT LoRA model's checkpoint: the adapters merged into the weight (PEFT's merge_and_unload
weight), then quantized, exactly as the trained model computes with lora "merged"; lora "beside"
is refused unless the caller asks for the requantized merge (docs/export.md)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import qtransform
from qtransform.core.lora import dense_weight, lora_layers
from qtransform.models import build_tiny
from tests.export.test_checkpoint import HIDDEN, decode, read

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]


def lora_model(lora: str):
    policy = {"preset": "llm-compressor/W4A16",
              "quantize": [{"name": "llm-compressor/W4A16 weights", "lora": lora}]}
    model = qtransform.transform(build_tiny("qwen2", hidden=HIDDEN), policy)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(3)
    return peft.get_peft_model(model, config)  # random A and B: a trained adapter, in effect


def weight_args(folder) -> dict:
    (group,) = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"].values()
    return group["weights"]


def test_lora_merged_then_quantized(tmp_path):
    model = lora_model("merged")
    qtransform.export_checkpoint(model, tmp_path / "out")
    tensors = read(tmp_path / "out")
    assert not any("lora" in name for name in tensors)
    args = weight_args(tmp_path / "out")
    checked = 0
    for name, layer in lora_layers(model):
        hf = name.removeprefix("base_model.model.")
        got = decode(tensors, hf, args, torch.float32)
        assert torch.equal(got, dense_weight(layer)), hf  # what the trained model computes with
        checked += 1
    assert checked == 2 * len(TARGETS)
    # PEFT's own merge, then the same quantizer
    merged = copy.deepcopy(model).merge_and_unload()
    for layer in range(2):
        for leaf in TARGETS:
            path = f"model.layers.{layer}.{'mlp' if leaf == 'down_proj' else 'self_attn'}.{leaf}"
            module = merged.get_submodule(path)
            expected = module.weight_fake_quant.quantized_copy(module.weight)
            assert torch.equal(decode(tensors, path, args, torch.float32), expected), path
            plain = model.get_submodule("base_model.model." + path + ".base_layer")
            assert not torch.equal(expected, plain.weight_fake_quant.quantized_copy(plain.weight))


def test_lora_beside_is_refused_unless_requantized(tmp_path):
    model = lora_model("beside")
    with pytest.raises(qtransform.UserError, match="lora 'beside'.*requantize_lora=True"):
        qtransform.export_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    qtransform.export_checkpoint(model, tmp_path / "out", requantize_lora=True)
    tensors = read(tmp_path / "out")
    merged = copy.deepcopy(model).merge_and_unload()
    module = merged.get_submodule("model.layers.1.mlp.down_proj")
    got = decode(tensors, "model.layers.1.mlp.down_proj", weight_args(tmp_path / "out"), torch.float32)
    assert torch.equal(got, module.weight_fake_quant.quantized_copy(module.weight))


@pytest.mark.parametrize("adapters", ["unrotated", "rotated"])
def test_lora_merged_on_a_rotated_site_stores_the_dense_weight(adapters, tmp_path):
    """A rotated site: rot(W) + rot(s B A) (adapters outside the rotation) or rot(W) + s B A
    (adapters see x·R), quantized: the weight the trained model computes with."""
    policy = {"preset": "llm-compressor/W4A16",
              "quantize": [{"name": "llm-compressor/W4A16 weights", "lora": "merged"}],
              "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32, "lora": adapters}]}
    model = qtransform.transform(build_tiny("qwen2", hidden=HIDDEN), policy)
    torch.manual_seed(3)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                       init_lora_weights=False))
    qtransform.export_checkpoint(model, tmp_path / "out")
    tensors = read(tmp_path / "out")
    args = weight_args(tmp_path / "out")
    for name, layer in lora_layers(model):
        hf = name.removeprefix("base_model.model.")
        assert torch.equal(decode(tensors, hf, args, torch.float32), dense_weight(layer)), hf
