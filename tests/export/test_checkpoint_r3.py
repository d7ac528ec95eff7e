"""Query and key rotations (rotate point `query_key`, SpinQuant's R3) in a compressed-tensors
checkpoint: the `transform_config` group at `q_attn` and `k_cache` (online both, as
llm-compressor's SpinQuant modifier writes R3), its matrix saved once as llm-compressor saves it,
opened back by `load_model` + `checkpoint_policy` to the exported model's logits bit for bit
(with an FP8 KV cache calibrated on the rotated keys); what qtransform cannot reproduce is
refused in one line. tests_llmc/test_spinquant_r3.py opens llm-compressor's own R3 folder."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import qtransform
from qtransform.errors import UserError
from qtransform.export.rotation_config import transform_config
from qtransform.models import build_tiny
from tests.export.test_checkpoint_rotation_reopen import _edit, checkpoint_policy, load_model

R3 = {"name": "R3", "point": "query_key", "block_size": 8}
POLICY = {"preset": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"], "rotate": [R3]}
MATRIX = "model.layers.0.self_attn.R3_q_attn.weight"


def data(vocab: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(3)], torch.randint(0, vocab, (3, 12), generator=g)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformed model, its export, calibration batches, ids) of a tiny Qwen2 as load_model gives it."""
    folder = tmp_path_factory.mktemp("r3")
    build_tiny("qwen2", hidden=128).save_pretrained(folder / "base")
    base = load_model(folder / "base")
    batches, ids = data(base.config.vocab_size)
    ours = qtransform.transform(base, POLICY, calibration=batches)
    return base, ours, qtransform.export_checkpoint(ours, folder / "ckpt", policy=None), batches, ids


def test_the_config_names_r3_at_q_attn_and_k_cache_and_saves_its_matrix_once(exported):
    _, _, folder, _, _ = exported
    config = json.loads((folder / "config.json").read_text())["quantization_config"]["transform_config"]
    sites = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert config == {"config_groups": {"rotate_query_key_8": {
        "type": "hadamard", "head_dim": 8, "randomize": False, "requires_grad": False,
        "precision": "torch.float32",
        "apply": [{"targets": sites, "location": "q_attn", "inverse": False, "ignore": []},
                  {"targets": sites, "location": "k_cache", "inverse": False, "ignore": []}]}}}
    tensors = load_file(folder / "model.safetensors")
    matrix = tensors["model.layers.0.self_attn.rotate_query_key_8_q_attn.weight"]
    assert [k for k in tensors if "rotate_query_key" in k] == ["model.layers.0.self_attn.rotate_query_key_8_q_attn.weight"]
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    assert torch.equal(matrix, torch.kron(torch.kron(h2, h2), h2))  # the unnormalized Sylvester H_8


def test_the_policy_names_its_rule_and_its_block():
    model = build_tiny("qwen2", hidden=128)
    policy = {"preset": "llm-compressor/FP8_DYNAMIC", "rotate": [R3]}
    program = qtransform.transform_program(model, policy)
    group = transform_config(policy, program)["config_groups"]["R3"]
    assert [a["location"] for a in group["apply"]] == ["q_attn", "k_cache"] and group["head_dim"] == 8
    with pytest.raises(UserError, match=r"rotate\[0\] 'R3': compressed-tensors cannot express kind 'random_hadamard'"):
        transform_config({"rotate": [{**R3, "kind": "random_hadamard", "seed": 1}]}, program)


def test_an_r3_export_opens_as_the_model_it_was(exported):
    base, ours, folder, batches, ids = exported
    opened = load_model(folder)
    assert not any("rotate_query_key" in key for key in opened.state_dict())  # the matrix is no tensor
    policy = checkpoint_policy(opened)
    assert policy["rotate"] == [{"name": "rotate_query_key_8", "kind": "hadamard", "block_size": 8,
                                 "point": "query_key",
                                 "targets": [r"re:model\.layers\.0\.self_attn", r"re:model\.layers\.1\.self_attn"]}]
    without = {**policy, "rotate": []}
    with torch.no_grad():
        expected = ours(ids).logits
        got = qtransform.transform(opened, policy)(ids).logits
        unrotated = qtransform.transform(opened, without)(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"
    assert not torch.equal(unrotated, expected)  # the KV cache's scales hold rotated keys
    recipe = checkpoint_policy(opened, weights=True)
    with torch.no_grad():
        again = qtransform.transform(base, recipe, calibration=batches)(ids).logits
    assert torch.equal(again, expected)


def test_a_reexport_writes_the_same_transform_config(exported, tmp_path):
    _, _, folder, _, _ = exported
    opened = load_model(folder)
    again = qtransform.export_checkpoint(qtransform.transform(opened, checkpoint_policy(opened, weights=True)),
                                         tmp_path / "again")
    configs = [json.loads((f / "config.json").read_text())["quantization_config"]["transform_config"]
               for f in (folder, again)]
    assert configs[0] == configs[1]


def test_a_query_rotated_without_its_key_is_not_exported(tmp_path):
    ours = qtransform.transform(build_tiny("qwen2", hidden=128), {"preset": "llm-compressor/FP8_DYNAMIC", "rotate": [R3]})
    ours.get_submodule("model.layers.1.self_attn").key_rotate.enabled = False
    with pytest.raises(UserError, match=r"model.layers.1.self_attn: its query and key are not rotated alike"):
        qtransform.export_checkpoint(ours, tmp_path / "ckpt")




@pytest.mark.parametrize(("change", "message"), [
    (lambda g: g.update(apply=g["apply"][:1]), r"applies q_attn; qtransform reproduces the query and key rotations as exactly the pair"),
    (lambda g: g["apply"][1].update(inverse=True), r"applies q_attn, k_cache inverse;"),
    (lambda g: g["apply"].append({"targets": ["re:.*q_proj$"], "location": "input"}), r"applies q_attn, k_cache, input;"),
    (lambda g: g["apply"][1].update(targets=["model.layers.0.self_attn"]), r"its two locations name different modules; the query and the key"),
    (lambda g: [a.update(targets=["re:.*q_proj$"]) for a in g["apply"]],
     r"rotates the query and key of model.layers.0.self_attn.q_proj \(Linear\), which is not an attention module"),
    (lambda g: g.update(head_dim=32), r"head_dim 32 does not divide the 16 head_dim of model.layers.0.self_attn"),
])
def test_query_key_rotations_qtransform_cannot_reproduce_are_refused(exported, tmp_path, change, message):
    with pytest.raises(UserError, match=message) as info:
        load_model(_edit(exported[2], tmp_path, change, "rotate_query_key_8"))
    assert "\n" not in str(info.value)
