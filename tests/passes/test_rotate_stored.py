"""A rotate rule with `weight: "stored"` (docs/rotations.md): the weight already holds W·R (an
opened rotated checkpoint), so only the input is rotated. A model whose weights are W·R with a
stored rule is the rotated model bit for bit, under every consumer of rotations: the forward
(with or without a weight quantizer), a weight scan (and its shared NVFP4 amax), PEFT LoRA
adapters on either side of the rotation, and the checkpoint export (the same bytes)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import qtransform
from qtransform.core.lora import dense_weight, lora_layers
from qtransform.models import build_tiny
from qtransform.schemas.errors import PolicyError
from qtransform.schemas.explain import explain

HIDDEN = 64
IDS = torch.tensor([[5, 17, 33, 8, 90, 2, 61], [3, 44, 21, 100, 7, 12, 9]])
LINEAR = {"targets": ["Linear"], "ignore": ["lm_head"]}
QUANT = {None: [], "mxfp4": [{**LINEAR, "format": "mxfp4"}],
         "nvfp4": [{**LINEAR, "format": "nvfp4", "nvfp4_variant": "compressed-tensors", "share_scale": "fused"}],
         "fp8": [{**LINEAR, "format": "fp8_e4m3", "granularity": "channel"}]}


def pair(rule: dict, quantize: list, lora: str = "unrotated"):
    """(the plain model rotated by `rule`, the model whose weights are stored W·R with the rule
    stored), both transformed with `quantize`."""
    model = build_tiny("qwen2", hidden=HIDDEN)
    rotated = qtransform.transform(model, {"rotate": [{**LINEAR, **rule, "lora": lora}], "quantize": quantize})
    stored = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in rotated.named_modules():
            if hasattr(module, "weight_rotate"):
                stored.get_submodule(name).weight.copy_(module.weight_rotate.rotate_weight(module.weight))
    policy = {"rotate": [{**LINEAR, **rule, "lora": lora, "weight": "stored"}], "quantize": quantize}
    return rotated, qtransform.transform(stored, policy)


@settings(max_examples=8, deadline=None)
@given(block=st.sampled_from([16, 32, 64]), kind=st.sampled_from(["hadamard", "random_hadamard"]),
       seed=st.integers(0, 5), quantize=st.sampled_from(sorted(QUANT, key=str)))
def test_stored_weights_with_a_stored_rule_are_the_rotated_model(block, kind, seed, quantize):
    rule = {"block_size": block, "kind": kind, **({"seed": seed} if kind == "random_hadamard" else {})}
    rotated, stored = pair(rule, QUANT[quantize])
    site = stored.get_submodule("model.layers.0.mlp.down_proj")
    assert not hasattr(site, "weight_rotate") and site.input_rotate.stored_weight
    with torch.no_grad():
        assert torch.equal(stored(IDS).logits, rotated(IDS).logits)


def test_the_weight_field_is_validated_and_explained():
    with pytest.raises(PolicyError, match=r"rotate\[0\]\.weight"):
        qtransform.load_policy({"rotate": [{**LINEAR, "weight": "fused"}]})
    text = explain(qtransform.load_policy({"rotate": [{**LINEAR, "block_size": 32, "weight": "stored"}]}))
    assert "the inputs of" in text and "Their weights already hold W·R (stored rotated)" in text
    plain = explain(qtransform.load_policy({"rotate": [{**LINEAR, "block_size": 32}]}))
    assert "the inputs and weights of" in plain and "stored rotated" not in plain


def test_a_weight_scan_measures_a_stored_rotated_weight_as_it_is():
    """The NVFP4 preset shares one amax over q/k/v: of W·R where the rule rotates, of the
    stored weight as it is where the rule says stored."""
    rotated, stored = pair({"block_size": 32}, [])
    policy = {"preset": "llm-compressor/NVFP4A16", "rotate": [{**LINEAR, "block_size": 32}]}
    kept = {**policy, "rotate": [{**LINEAR, "block_size": 32, "weight": "stored"}]}
    plain = build_tiny("qwen2", hidden=HIDDEN)
    stored_plain = copy.deepcopy(plain)
    stored_plain.load_state_dict({k: v for k, v in stored.state_dict().items() if k in plain.state_dict()})
    a = {r.site: r.metrics for r in qtransform.scan_weights(plain, policy=policy).rows}
    b = {r.site: r.metrics for r in qtransform.scan_weights(stored_plain, policy=kept).rows}
    twice = {r.site: r.metrics for r in qtransform.scan_weights(stored_plain, policy=policy).rows}
    assert a == b
    assert twice != a  # rotating the stored W·R again measures another weight


@pytest.mark.parametrize("lora", ["unrotated", "rotated"])
def test_lora_on_a_stored_rotated_site_is_lora_on_the_rotated_site(lora, tmp_path):
    peft = pytest.importorskip("peft")
    quantize = [{**LINEAR, "format": "mxfp4", "lora": "merged"}]
    models = []
    for model in pair({"block_size": 32}, quantize, lora):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                 init_lora_weights=False)
        models.append(peft.get_peft_model(model, config))  # the same random adapters on both
    rotated, stored = models
    for (name, a), (_, b) in zip(lora_layers(rotated), lora_layers(stored), strict=True):
        assert torch.equal(dense_weight(a), dense_weight(b)), name
    with torch.no_grad():
        assert torch.equal(stored(IDS).logits, rotated(IDS).logits)
    for name, model in (("rotated", rotated), ("stored", stored)):
        qtransform.export_checkpoint(model, tmp_path / name)
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("rotated", "stored"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_onnx_of_a_stored_rotation_has_input_rotations_only(tmp_path):
    """The Rotate nodes of the input points only, and the rotated model's outputs in
    onnxruntime bit for bit (its weight Rotate nodes compute the W·R stored here)."""
    import onnx
    import onnxruntime as ort

    outputs = []
    for name, model in zip(("rotated", "stored"), pair({"block_size": 32}, QUANT["mxfp4"]), strict=True):
        proto = onnx.load(str(qtransform.export_onnx(model, tmp_path / f"{name}.onnx", {"input_ids": IDS})))
        nodes = {n.name for n in proto.graph.node if n.op_type == "Rotate" and n.domain == "qtransform"}
        sites = [s for s, m in model.named_modules() if hasattr(m, "input_rotate")]
        points = ("weight", "input") if name == "rotated" else ("input",)
        assert nodes == {f"{s}/{p}_rotate" for s in sites for p in points} and len(sites) == 14
        outputs.append(ort.InferenceSession(proto.SerializeToString()).run(None, {"input_ids": IDS.numpy()})[0])
    assert np.array_equal(*outputs)


def test_unrotated_lora_on_a_stored_rotated_conv1d_is_refused():
    """GPT-2's Conv1D keeps its weight [in, out]: the input's rotation does not say how its
    delta turns, so adapters outside the rotation are refused (inside, lora "rotated", they are not)."""
    peft = pytest.importorskip("peft")
    for lora in ("unrotated", "rotated"):
        model = qtransform.transform(build_tiny("gpt2", hidden=HIDDEN), {"rotate": [
            {"targets": ["re:.*c_fc"], "block_size": 32, "weight": "stored", "lora": lora}]})
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_fc"], fan_in_fan_out=True,
                                                           init_lora_weights=False))
        (_, layer), *_ = lora_layers(model)
        if lora == "rotated":
            assert dense_weight(layer).shape == layer.base_layer.weight.shape
            continue
        with pytest.raises(qtransform.UserError, match="a LoRA adapter on a Conv1D whose weight is stored "
                           r"rotated \(rotate rule weight 'stored'\).*set the rule's lora to 'rotated'"):
            dense_weight(layer)
