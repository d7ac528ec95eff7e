"""qtransform's `transform_config` (export/rotation_config.py) read by compressed-tensors itself:
its pydantic `TransformConfig` accepts it, and its own `apply_transform_config` on the plain
model rotates the same inputs and fuses the same weights as qtransform's rotate pass."""

from __future__ import annotations

import copy

import pytest
import torch

import qtransform
from qtransform.export.rotation_config import transform_config
from qtransform.models import build_tiny

ct = pytest.importorskip("compressed_tensors.transform")
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("block", [16, 32, 64])
def test_compressed_tensors_applies_our_transform_config_as_our_pass_rotates(arch, block):
    model = build_tiny(arch)
    pol = {"version": 1, "rotate": [{"name": "h", "targets": ["Linear"], "ignore": ["lm_head"],
                                     "block_size": block}]}
    program = qtransform.transform_program(model, pol)
    data = transform_config(pol, program)
    config = ct.TransformConfig.model_validate(data)
    assert config.model_dump(mode="json")["config_groups"]["h"]["head_dim"] == block
    theirs = copy.deepcopy(model)
    ct.apply_transform_config(theirs, config)
    ours = program.model
    seen: dict[str, dict[str, torch.Tensor]] = {"ours": {}, "theirs": {}}
    names = data["config_groups"]["h"]["apply"][0]["targets"]
    for who, m in (("ours", ours), ("theirs", theirs)):
        for name in names:
            m.get_submodule(name).register_forward_hook(
                lambda mod, args, out, who=who, name=name: seen[who].__setitem__(name, args[0].detach()))
    with torch.no_grad():
        out_ours = ours(input_ids=IDS).logits
        out_theirs = theirs(input_ids=IDS).logits
        for name in names:
            site = ours.get_submodule(name)
            rotated_input = site.input_rotate(seen["ours"][name])  # ours rotates inside the site
            torch.testing.assert_close(seen["theirs"][name], rotated_input, rtol=0, atol=3e-6)
            fused = theirs.get_submodule(name).weight  # compressed-tensors' W·H/√b (float64 made)
            torch.testing.assert_close(fused, site.weight_rotate(site.weight), rtol=0, atol=2e-6)
    torch.testing.assert_close(out_theirs, out_ours, rtol=0, atol=1e-5)
