"""Re-opening a rotated export: a checkpoint whose
`transform_config` holds online Hadamard rotations opens with `load_model` as the model its
engine runs (stored weights W·R quantized, the inputs rotated online by the policy's rotate rules
with `weight: "stored"`), bit for bit in bf16 for every preset; a re-export writes the same
transform_config, and the same bytes where re-quantizing a dequantized weight is idempotent;
`plan` names the rotations; what qtransform cannot reproduce is refused in one line.
tests_llmc/test_checkpoint_rotations.py opens llm-compressor's own QuIP folders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny, checkpoint_policy, load_model

ROTATE = [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 32}]
PRESETS = ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "W4A16", "FP8_DYNAMIC", "FP8", "W8A8")
MATRIX = "model.layers.0.self_attn.q_proj.rotate_32_input.weight"  # the online H_32 as saved


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A bf16 tiny Qwen2 as load_model gives it (so the opened export differs by its weights only)."""
    folder = tmp_path_factory.mktemp("base")
    build_tiny("qwen2", hidden=128, dtype=torch.bfloat16).save_pretrained(folder)
    return load_model(folder)


def data(base):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, base.config.vocab_size, (1, 16), generator=g) for _ in range(4)]
    return batches, torch.randint(0, base.config.vocab_size, (3, 12), generator=g)


def rotated_export(base, preset: str, folder):
    batches, ids = data(base)
    transformed = qtransform.transform(base, {"preset": f"llm-compressor/{preset}", "rotate": ROTATE},
                                       calibration=batches)
    return transformed, qtransform.export_checkpoint(transformed, folder), batches, ids


@pytest.fixture(scope="module")
def nvfp4a16(base, tmp_path_factory):
    return rotated_export(base, "NVFP4A16", tmp_path_factory.mktemp("nvfp4a16") / "ckpt")[1]


@pytest.mark.parametrize("preset", PRESETS)
def test_a_rotated_export_opens_as_the_model_it_was(base, preset, tmp_path):
    transformed, folder, batches, ids = rotated_export(base, preset, tmp_path / "ckpt")
    opened = load_model(folder)
    state = opened.state_dict()
    assert not any(key.endswith("_input.weight") for key in state)  # the online matrix is no tensor
    for name, module in transformed.named_modules():
        if getattr(module, "weight_fake_quant", None) is not None:
            with torch.no_grad():  # the stored weight is quant(W·R), used as it is
                expected = module.weight_fake_quant(module.weight_rotate(module.weight))
            assert torch.equal(state[f"{name}.weight"], expected), name
    policy = checkpoint_policy(opened)
    [rule] = policy["rotate"]
    assert (rule["name"], rule["kind"], rule["block_size"], rule["weight"]) == ("rotate_32", "hadamard", 32, "stored")
    assert len(rule["targets"]) == 14 and "re:lm_head" not in rule["targets"]
    reopened = qtransform.transform(opened, policy)
    site = reopened.get_submodule("model.layers.0.mlp.down_proj")
    assert not hasattr(site, "weight_rotate") and site.input_rotate.stored_weight
    with torch.no_grad():
        expected = transformed(ids).logits
        got = reopened(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"
    # the whole recipe (weights=True): ordinary rotations of the full-precision model's weights
    recipe = checkpoint_policy(opened, weights=True)
    assert recipe["rotate"][0]["weight"] == "rotate"
    with torch.no_grad():
        again = qtransform.transform(base, recipe, calibration=batches)(ids).logits
    assert torch.equal(again, expected), f"max |diff| {(again - expected).abs().max().item():.3g}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.mark.parametrize("preset", ["MXFP4A16", "FP8"])
def test_a_reexport_of_an_opened_rotated_checkpoint_writes_the_same_files(base, preset, tmp_path):
    """The stored W·R is taken as it is (not rotated again); MXFP4's and FP8's quantizers give
    a dequantized weight back its own codes (NVFP4 and the integers do not: their scale is
    recomputed from the smaller dequantized amax, a second rounding the docs name)."""
    _, folder, _, _ = rotated_export(base, preset, tmp_path / "ckpt")
    opened = load_model(folder)
    policy = {**checkpoint_policy(opened, weights=True), "rotate": checkpoint_policy(opened)["rotate"]}
    qtransform.export_checkpoint(opened, tmp_path / "again", policy=policy)
    a, b = load_file(folder / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(a) == sorted(b) and MATRIX in a
    assert all(a[k].dtype == b[k].dtype and torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)
    config = [json.loads((f / "config.json").read_text())["quantization_config"] for f in (folder, tmp_path / "again")]
    assert config[0]["transform_config"] == config[1]["transform_config"] != {}
    assert config[0] == config[1]


def test_plan_names_the_rotations(nvfp4a16):
    out = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", str(nvfp4a16)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "compressed-tensors checkpoint: weights nvfp4, activations 16-bit" in out.stdout
    assert "online 32-wide Hadamard rotations ('rotate_32') of the inputs of 14 modules, whose stored weights hold W·R" in out.stdout


def _edit(folder, tmp_path, change, group: str = "rotate_32"):
    """A copy of the export with its transform_config group `group` changed."""
    copy = tmp_path / "edited"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    change(config["quantization_config"]["transform_config"]["config_groups"][group])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def _drop_weight_input(group):
    group["apply"] = group["apply"][:1]


def _drop_input(group):
    group["apply"] = group["apply"][1:]


def _output(group):
    group["apply"][0]["location"] = "output"


@pytest.mark.parametrize(("change", "message"), [
    (lambda g: g.update(type="random-hadamard"),
     r"group 'rotate_32': type 'random-hadamard', whose matrices compressed-tensors draws from torch's generator"),
    (lambda g: g.update(type="random-matrix"), r"group 'rotate_32': type 'random-matrix'"),
    (lambda g: g.update(randomize=True), r"group 'rotate_32': randomize true \(a permutation drawn"),
    (lambda g: g.update(precision="torch.bfloat16"), r"group 'rotate_32': online rotations in torch.bfloat16"),
    (_drop_weight_input, r"group 'rotate_32': applies input; qtransform reproduces exactly the pair"),
    (_drop_input, r"group 'rotate_32': applies weight_input inverse; .*an online rotation without its fused inverse"),
    (_output, r"group 'rotate_32': location 'output'"),
    (lambda g: g.update(head_dim=256), r"group 'rotate_32': head_dim 256 does not divide the 128 input features"),
    (lambda g: g.update(head_dim=24), r"group 'rotate_32': head_dim 24; a Hadamard block is a power of two"),
])
def test_rotations_qtransform_cannot_reproduce_are_refused(nvfp4a16, tmp_path, change, message):
    with pytest.raises(UserError, match=message) as info:
        load_model(_edit(nvfp4a16, tmp_path, change))
    assert "\n" not in str(info.value)


def test_a_stored_online_matrix_other_than_hadamard_is_refused(nvfp4a16, tmp_path):
    folder = _edit(nvfp4a16, tmp_path, lambda g: None)
    tensors = load_file(folder / "model.safetensors")
    signs = torch.where(torch.rand(32, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    tensors[MATRIX] = signs[:, None] * tensors[MATRIX]  # a random Hadamard: another rotation
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"rotate_32_input.weight: the stored matrix of transform group 'rotate_32' "
                                        r"\(shape \[32, 32\]\) is not the Hadamard matrix"):
        load_model(folder)


def test_a_policy_without_the_stored_rotations_is_refused(nvfp4a16):
    """Leaving the online rotation out, or rotating the stored W·R again, is another model."""
    opened = load_model(nvfp4a16)
    policy = checkpoint_policy(opened)
    for wrong in ({**policy, "rotate": []},
                  {**policy, "rotate": [{**policy["rotate"][0], "weight": "rotate"}]},
                  {**policy, "rotate": [{**policy["rotate"][0], "block_size": 16}]}):
        with pytest.raises(UserError, match=r"model.layers.0.self_attn.q_proj: the checkpoint stores its "
                           r"weight rotated \(W·R, transform_config group 'rotate_32'\), so its input needs "
                           r"the 32-wide Hadamard rotation online and its weight none; the policy does "
                           r"otherwise \(and 13 more modules\)"):
            qtransform.transform(opened, wrong)
