"""A preset refuses what its stack refuses: llm-compressor's 1D groups must divide the input
features of every Linear they quantize (tests_llmc/test_presets.py checks that llm-compressor
refuses the same model), at transform and plan time, naming the module, its shape and the fix."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.schemas.presets import Constraint, Preset, register_preset

# hidden 192: q/k/v/o and gate/up take 192 input features (not a multiple of 128, a multiple of
# 16 and 32), down_proj takes 384 (3 x 128)
HIDDEN = 192
Q_PROJ = "model.layers.0.self_attn.q_proj"


STACK_SAYS = {
    "weights": "llm-compressor refuses it: group and tensor-group quantization require columns % "
               "group_size == 0; compressed-tensors will error when saving or running forward",
    "inputs": "compressed-tensors' forward fails on it: its dynamic activation groups cannot split "
              "the input features (unflatten ... don't multiply up)"}


def refusal(scheme: str, part: str) -> str:
    return (f"quantize[{1 if part == 'inputs' else 0}] 'llm-compressor/{scheme} {part}': {Q_PROJ} "
            "(weight [192, 192]) cannot be quantized as its stack does: its 192 input features are "
            f"not a multiple of the group size 128 ({STACK_SAYS[part]}); ignore the module (add it "
            "to the rule's ignore list) or set a block_size that divides 192 (such as 64)")


@pytest.mark.parametrize(("scheme", "part"), [("W4A16", "weights"), ("FP8_BLOCK", "inputs")])
def test_a_preset_refuses_groups_its_stack_refuses(scheme, part):
    model = build_tiny("qwen2", hidden=HIDDEN)
    policy = {"preset": f"llm-compressor/{scheme}"}
    with pytest.raises(UserError) as transform_error:
        qtransform.transform(model, policy)
    assert str(transform_error.value) == refusal(scheme, part)
    with pytest.raises(UserError) as plan_error:
        qtransform.plan(model, policy)
    assert str(plan_error.value) == refusal(scheme, part)


def test_the_fixes_it_names_are_accepted():
    model = build_tiny("qwen2", hidden=HIDDEN)
    ids = torch.arange(12).reshape(1, 12)
    smaller = qtransform.transform(model, {"preset": "llm-compressor/W4A16", "quantize": [
        {"name": "llm-compressor/W4A16 weights", "block_size": 64}]})
    only_down = qtransform.transform(model, {"preset": "llm-compressor/W4A16", "quantize": [
        {"name": "llm-compressor/W4A16 weights", "ignore": ["lm_head", "re:.*_proj(?<!down_proj)"]}]})
    with torch.no_grad():
        plain, a, b = model(ids).logits, smaller(ids).logits, only_down(ids).logits
    assert not torch.equal(a, plain) and not torch.equal(b, plain) and not torch.equal(a, b)


@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4", "W8A8", "FP8"])
def test_groups_that_divide_and_per_channel_schemes_pass(scheme):
    model = build_tiny("qwen2", hidden=HIDDEN)
    batches = [torch.arange(16).reshape(1, 16)]
    out = qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}, calibration=batches)
    assert len(qtransform.insertion_log(out)) > 0


def test_a_constraint_must_name_a_rule_of_its_preset_and_a_known_check():
    content = {"quantize": [{"name": "test-stack/W4 weights", "format": "int4"}]}
    with pytest.raises(ValueError, match="names no quantize rule"):
        register_preset(Preset("test-stack/W4", "int4", "", content,
                               constraints=(Constraint("test-stack/other", "groups_divide", "no"),)))
    with pytest.raises(ValueError, match="names no quantize rule"):
        register_preset(Preset("test-stack/W4", "int4", "", content,
                               constraints=(Constraint("test-stack/W4 weights", "unknown", "no"),)))
