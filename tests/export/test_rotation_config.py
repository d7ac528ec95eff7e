"""compressed-tensors' `transform_config` of a policy's rotations (export/rotation_config.py).

The JSON is checked here field by field against what compressed-tensors 0.19's
`TransformScheme` / `TransformArgs` mean (read from its sources: hadamard = Sylvester H/√b,
`head_dim` the block, "input" online, "weight_input" fused); tests_llmc validates it with
compressed-tensors' own pydantic model and applies it to the model."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.export.rotation_config import transform_config
from qtransform.models import build_tiny


def _program(arch: str, pol: dict):
    return qtransform.transform_program(build_tiny(arch), pol)


def test_a_hadamard_rule_is_one_config_group_with_the_online_and_the_fused_locations():
    pol = {"version": 1, "rotate": [{"name": "h32", "targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32},
                                    {"targets": ["mlp.down_proj"], "block_size": 128}],
           "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}
    cfg = transform_config(pol, _program("qwen2", pol))
    assert set(cfg) == {"config_groups"} and set(cfg["config_groups"]) == {"h32", "rotate_1"}
    h32 = cfg["config_groups"]["h32"]
    assert h32["type"] == "hadamard" and h32["head_dim"] == 32 and h32["randomize"] is False
    online, fused = h32["apply"]
    assert (online["location"], online["inverse"]) == ("input", False)
    assert (fused["location"], fused["inverse"]) == ("weight_input", True)
    assert online["targets"] == fused["targets"]
    assert "model.layers.0.self_attn.q_proj" in online["targets"]
    assert "model.layers.0.mlp.down_proj" not in online["targets"]  # the later rule has it
    assert "lm_head" not in online["targets"]
    assert cfg["config_groups"]["rotate_1"]["apply"][0]["targets"] == [
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert cfg["config_groups"]["rotate_1"]["head_dim"] == 128


def test_no_rotation_no_transform_config():
    pol = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}]}
    assert transform_config(pol, _program("qwen2", pol)) is None


@pytest.mark.parametrize(("arch", "rule", "why"), [
    ("qwen2", {"kind": "random_hadamard", "seed": 3}, "Philox"),
    ("qwen2_moe", {"targets": ["re:.*experts.*"]}, "nn.Linear modules only"),
    ("gpt2", {"targets": ["Conv1D"], "block_size": 16}, "nn.Linear modules only"),
])
def test_what_compressed_tensors_cannot_express_is_refused_with_the_reason(arch, rule, why):
    pol = {"version": 1, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32, **rule}]}
    with pytest.raises(UserError, match=why) as err:
        transform_config(pol, _program(arch, pol))
    assert "rotate[0]" in str(err.value)


def test_a_matrix_rotation_is_refused(tmp_path):
    torch.save(torch.eye(64), tmp_path / "r.pt")
    pol = {"version": 1, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "kind": "matrix",
                                     "matrix": str(tmp_path / "r.pt")}]}
    with pytest.raises(UserError, match="cannot express kind 'matrix'"):
        transform_config(pol, _program("qwen2", pol))
