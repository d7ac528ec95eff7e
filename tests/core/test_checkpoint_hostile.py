"""Hostile quantized folders: real exports (qtransform's own compressed-tensors and ModelOpt
writers) tampered one tensor or one file at a time. Each must be refused in one line that names
the tensor (or file) and where it is, by the API and by the CLI (exit 2, no traceback); none may
open as a silently wrong model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model

CALIB = [{"input_ids": torch.arange(16).reshape(2, 8) % 200}]
MODULE = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One folder per layout, written by qtransform's exporter from a tiny bf16 Qwen2."""
    root = tmp_path_factory.mktemp("exports")
    model = build_tiny("qwen2", hidden=64, dtype=torch.bfloat16)
    out = {}
    for name, preset, fmt in (("nvfp4", "llm-compressor/NVFP4", "compressed-tensors"),
                              ("mxfp4", "llm-compressor/MXFP4A16", "compressed-tensors"),
                              ("fp8", "llm-compressor/FP8", "compressed-tensors"),
                              ("modelopt", "modelopt/NVFP4_DEFAULT_CFG", "modelopt")):
        out[name] = qtransform.export_checkpoint(model, root / name, policy={"preset": preset},
                                                 calibration=CALIB, format=fmt)
    return out


def tampered(tmp_path, source, change):
    """A copy of `source` whose safetensors state dict went through `change`."""
    folder = tmp_path / "bad"
    shutil.copytree(source, folder)
    file = folder / "model.safetensors"
    state = load_file(str(file))
    change(state)
    save_file(state, str(file), metadata={"format": "pt"})
    return folder


def refused(folder, *pieces):
    """load_model refuses `folder` in one line naming `pieces`."""
    with pytest.raises(UserError) as err:
        load_model(folder)
    message = str(err.value)
    assert "\n" not in message
    for piece in pieces:
        assert piece in message, (piece, message)
    return message


def test_the_cli_refuses_a_hostile_folder_in_one_line(tmp_path, exports):
    folder = tampered(tmp_path, exports["nvfp4"], put(f"{MODULE}.weight_scale", nan_at_first))
    cli = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", str(folder)],
                         capture_output=True, text=True)
    assert cli.returncode == 2, cli.stderr
    assert "Traceback" not in cli.stderr
    assert f"{MODULE}.weight_scale holds NaN values" in cli.stderr


def put(name, value):
    def change(state):
        state[name] = value(state[name])
    return change


def nan_at_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


@pytest.mark.parametrize("layout,tensor,value,word", [
    ("nvfp4", "weight_scale", nan_at_first, "NaN"),
    ("nvfp4", "weight_global_scale", lambda t: torch.full_like(t, float("inf")), "infinite"),
    ("nvfp4", "weight_global_scale", lambda t: -t, "negative"),
    ("nvfp4", "input_global_scale", lambda t: torch.full_like(t, float("nan")), "NaN"),
    ("nvfp4", "input_global_scale", lambda t: torch.zeros_like(t), "zero"),
    ("fp8", "weight_scale", lambda t: -t, "negative"),
    ("fp8", "input_scale", lambda t: torch.full_like(t, float("inf")), "infinite"),
    ("modelopt", "weight_scale_2", lambda t: torch.full_like(t, float("nan")), "NaN"),
    ("modelopt", "input_scale", lambda t: -t, "negative"),
])
def test_bad_scale_values_are_refused_naming_tensor_and_file(tmp_path, exports, layout, tensor, value, word):
    folder = tampered(tmp_path, exports[layout], put(f"{MODULE}.{tensor}", value))
    message = refused(folder, f"{MODULE}.{tensor}", word)
    assert "model.safetensors" in message


def test_mxfp4_nan_exponent_code_is_refused(tmp_path, exports):
    def change(state):
        t = state[f"{MODULE}.weight_scale"].clone()
        t.view(-1)[3] = 255
        state[f"{MODULE}.weight_scale"] = t
    refused(tampered(tmp_path, exports["mxfp4"], change), f"{MODULE}.weight_scale", "NaN")


@pytest.mark.parametrize("layout,missing,left", [
    ("nvfp4", "weight_global_scale", "weight_global_scale"),
    ("fp8", "weight_scale", "weight_scale"),  # the FP8 weight is left without any scale
    ("modelopt", "weight_scale", "weight_scale"),
])
def test_missing_scale_tensors_are_refused(tmp_path, exports, layout, missing, left):
    folder = tampered(tmp_path, exports[layout], lambda state: state.pop(f"{MODULE}.{missing}"))
    refused(folder, MODULE, left)


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path, exports):
    folder = tampered(tmp_path, exports["nvfp4"], put(f"{MODULE}.weight_scale", lambda t: t[:, :2].contiguous()))
    refused(folder, MODULE, "does not fit blocks of 16")


def test_a_plain_tensor_of_the_wrong_shape_is_refused(tmp_path, exports):
    folder = tampered(tmp_path, exports["fp8"], put("model.norm.weight", lambda t: t[:10].contiguous()))
    refused(folder, "model.norm.weight", "expects [64]")


def test_an_unknown_format_is_refused(tmp_path, exports):
    folder = tmp_path / "bad"
    shutil.copytree(exports["fp8"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
    (folder / "config.json").write_text(json.dumps(config))
    refused(folder, "marlin-24")


def test_shards_are_checked_against_their_index(tmp_path):
    """A sharded export whose index names a missing shard, or a shard the index does not list."""
    model = build_tiny("qwen2", hidden=64, dtype=torch.bfloat16)
    source = qtransform.export_checkpoint(model, tmp_path / "sharded", max_shard_size="40KB",
                                          policy={"preset": "llm-compressor/FP8_DYNAMIC"})
    shards = sorted(source.glob("model-*.safetensors"))
    assert len(shards) > 2
    gone = tmp_path / "gone"
    shutil.copytree(source, gone)
    (gone / shards[1].name).unlink()
    refused(gone, shards[1].name)
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    index = json.loads((moved / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v == shards[0].name)
    index["weight_map"][key] = shards[-1].name  # the index says another shard holds it
    (moved / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(moved, "model.safetensors.index.json", key)


def test_an_untampered_export_still_opens(exports):
    """The checks refuse the tampered folders only (zero block scales of all-zero blocks stay)."""
    for folder in exports.values():
        model = load_model(folder)
        assert all(torch.isfinite(p).all() for p in model.parameters())
