"""Policy fields of the per-channel, per-token and fp8 formats: `granularity`, `int_range`, `scale_dtype`, the fp8
formats; their validation (one line per problem, naming the fix) and their words in `explain`."""

from __future__ import annotations

import pytest

from qtransform.schemas import PolicyError
from qtransform.schemas.explain import explain
from qtransform.schemas.loading import validate_policy


def _policy(*rules: dict) -> dict:
    return {"version": 1, "quantize": [{"targets": ["Linear"], **r} for r in rules]}


W8A8 = _policy({"format": "int8", "granularity": "channel", "int_range": "full"},
               {"format": "int8", "granularity": "token", "int_range": "full", "tensors": ["input"]})


def test_stack_schemes_validate_and_explain_in_words():
    text = explain(validate_policy(W8A8))
    assert ("to INT8 (INT8 elements, one scale per output channel, FP32 scale, round-half-even, "
            "full integer range, float32 scales)") in text
    assert "one scale per token" in text
    fp8 = explain(validate_policy(_policy(
        {"format": "fp8_e4m3", "block_shape": [128, 128], "scale_dtype": "input"},
        {"format": "fp8_e4m3", "block_size": 128, "tensors": ["input"]},
        {"format": "fp8_e5m2", "granularity": "tensor", "tensors": ["output"]})))
    assert "FP8_E4M3 (E4M3 elements, 128x128 weight tiles, FP32 scale, round-half-even, scales in the input's dtype" in fp8
    assert "FP8_E4M3 (E4M3 elements, block 128," in fp8 and "one scale per tensor" in fp8


def test_rule_config_carries_the_new_fields():
    rules = validate_policy(W8A8).quantize
    cfg = rules[0].config()
    assert (cfg.granularity, cfg.int_range, cfg.block) == ("channel", "full", 0)
    assert rules[1].config().describe() == "int8 per token, rounding=rne, int_range=full, scale_dtype=float32"
    mx = validate_policy(_policy({"format": "mxfp8_e4m3", "scale_rule": "compressed-tensors"})).quantize[0]
    assert mx.config().scale_rule == "compressed-tensors"


@pytest.mark.parametrize(("rule", "problem"), [
    ({"format": "int8", "granularity": "channel", "tensors": ["weight", "input"]},
     'quantize[0].granularity: one scale per output channel is for weights: set tensors to '
     '["weight"], and use "token" in a rule for inputs or outputs; got ["weight", "input"]'),
    ({"format": "int8", "granularity": "token"},
     'quantize[0].granularity: one scale per token is for activations: use "channel" in a rule '
     'for weights; got ["weight"]'),
    ({"format": "mxfp4", "granularity": "tensor"},
     "quantize[0].granularity: not available for mxfp4 (its scales are e8m0); got 'tensor'; "
     "allowed: block, tile"),
    ({"format": "fp8_e4m3", "granularity": "channel", "block_size": 64},
     "quantize[0].block_size: granularity 'channel' has one scale per whole row; remove it; got 64"),
    ({"format": "fp8_e4m3", "granularity": "tile", "tensors": ["input"]},
     'quantize[0].granularity: 2D tiles apply to weights only; set tensors to ["weight"] or use '
     'block_size; got ["input"]'),
    ({"format": "nvfp4", "int_range": "full"},
     "quantize[0].int_range: not supported by nvfp4; got 'full'; allowed: restricted"),
    ({"format": "int4", "scale_dtype": "bf16"},
     "quantize[0].scale_dtype: unknown value; got 'bf16'; allowed: float32, bfloat16, float16, input"),
    ({"format": "int4", "granularity": "row"},
     "quantize[0].granularity: unknown value; got 'row'; allowed: block, channel, token, tensor, tile"),
])
def test_bad_fields_are_one_line_each(rule, problem):
    with pytest.raises(PolicyError) as err:
        validate_policy(_policy(rule))
    assert problem in str(err.value)
