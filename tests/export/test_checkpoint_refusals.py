"""What a checkpoint format cannot express is refused before any file is written, in one line
that says why (docs/export.md); never a folder that loads into other numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import qtransform
from qtransform.export.checkpoint import Refused
from qtransform.models import build_tiny

HIDDEN = 128
LINEAR = {"targets": ["Linear"], "ignore": ["lm_head"]}
NVFP4_CT = {"format": "nvfp4", "nvfp4_variant": "compressed-tensors", "share_scale": "fused"}


def refused(policy: dict, tmp_path, match: str, **kwargs) -> str:
    model = qtransform.transform(build_tiny("qwen2", hidden=HIDDEN), policy, **kwargs)
    with pytest.raises(Refused, match=match) as info:
        qtransform.export_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind either
    assert "\n" not in str(info.value)
    return str(info.value)


def test_stochastic_rounding(tmp_path):
    refused({"quantize": [{**LINEAR, **NVFP4_CT, "rounding": "stochastic", "seed": 1}]}, tmp_path,
            "stochastic rounding draws new values every forward")


def test_a_scale_rule_the_format_has_no_field_for(tmp_path):
    """MXFP4 activation scales are computed by the engine with compressed-tensors' rule."""
    refused({"quantize": [{**LINEAR, "format": "mxfp4", "scale_rule": "even"},
                          {**LINEAR, "tensors": ["input"], "format": "mxfp4", "scale_rule": "floor"}]},
            tmp_path, "scale_rule 'floor'.*no field for another rule")


def test_weight_scale_rules_are_stored_as_they_are(tmp_path):
    """A weight's E8M0 exponents are stored, whatever rule chose them: no refusal."""
    model = qtransform.transform(build_tiny("qwen2", hidden=HIDDEN),
                                 {"quantize": [{**LINEAR, "format": "mxfp4", "scale_rule": "floor"}]})
    qtransform.export_checkpoint(model, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_granularity_the_format_has_no_field_for(tmp_path):
    refused({"quantize": [{**LINEAR, **NVFP4_CT, "block_shape": [16, 16]}]}, tmp_path,
            "1x16 blocks")


def test_an_nvfp4_order_compressed_tensors_does_not_decode(tmp_path):
    refused({"quantize": [{**LINEAR, "format": "nvfp4", "share_scale": "fused"}]}, tmp_path,
            "nvfp4_variant 'default'.*use nvfp4_variant 'compressed-tensors'")


def test_a_fused_group_half_quantized(tmp_path):
    text = refused({"quantize": [{"targets": ["q_proj", "gate_proj", "up_proj", "down_proj", "o_proj"],
                                  "format": "fp8_e4m3", "granularity": "channel"}]},
                   tmp_path, "q_proj/k_proj/v_proj run as one fused Linear")
    assert "q_proj is quantized and k_proj, v_proj not" in text


def test_fused_siblings_with_their_own_nvfp4_global_scales(tmp_path):
    refused({"quantize": [{**LINEAR, "format": "nvfp4", "nvfp4_variant": "compressed-tensors"}]},
            tmp_path, "own NVFP4 global scales.*share_scale 'fused'")


def test_a_pass_that_changes_values_with_no_field(tmp_path):
    """A clamp cannot be removed from the numbers the model computes, nor stored."""
    refused({"quantize": [{**LINEAR, **NVFP4_CT}], "clamp": {"targets": ["o_proj"], "limit": 1.0}},
            tmp_path, "the 'clamp' pass changes the values and no checkpoint field holds it")


def test_a_format_with_no_checkpoint_form(tmp_path):
    refused({"quantize": [{**LINEAR, "format": "mxfp6_e2m3"}]}, tmp_path,
            "format mxfp6_e2m3 has no compressed-tensors form")


def test_output_quantization(tmp_path):
    refused({"quantize": [{**LINEAR, "format": "fp8_e4m3", "granularity": "tensor",
                           "tensors": ["weight", "output"]}]}, tmp_path, "output quantization")


def test_nvfp4_activations_with_a_per_token_global_scale(tmp_path):
    refused({"quantize": [{**LINEAR, **NVFP4_CT, "tensors": ["weight", "input"]}]}, tmp_path,
            "one calibrated global scale.*scale_source 'static'")


def test_every_reason_is_named_once(tmp_path):
    text = refused({"quantize": [{**LINEAR, "format": "mxfp6_e2m3"},
                                 {"targets": ["o_proj"], **NVFP4_CT, "rounding": "stochastic", "seed": 0}]},
                   tmp_path, "mxfp6_e2m3")
    assert "also:" in text and "stochastic" in text


def test_an_unknown_format_name_and_a_model_without_quantization(tmp_path):
    model = build_tiny("qwen2", hidden=HIDDEN)
    with pytest.raises(qtransform.UserError, match="choose one of compressed-tensors, modelopt"):
        qtransform.export_checkpoint(model, tmp_path / "out", format="gguf", policy={"preset": "llm-compressor/FP8"})
    with pytest.raises(qtransform.UserError, match="has no quantization"):
        qtransform.export_checkpoint(model, tmp_path / "out")
    with pytest.raises(qtransform.UserError, match="max_shard_size 'lots'"):
        qtransform.export_checkpoint(model, tmp_path / "out", max_shard_size="lots")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_not_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    model = qtransform.transform(build_tiny("qwen2", hidden=HIDDEN), {"preset": "llm-compressor/W8A8"})
    with pytest.raises(qtransform.UserError, match="qtransform did not write"):
        qtransform.export_checkpoint(model, tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    qtransform.export_checkpoint(model, tmp_path / "again")
    qtransform.export_checkpoint(model, tmp_path / "again")  # its own earlier export: replaced


def test_the_cli_refuses_in_one_line_without_a_traceback(tmp_path):
    policy = tmp_path / "p.json"
    policy.write_text('{"quantize": [{"targets": ["Linear"], "format": "nvfp4"}]}')
    run = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "export", "builtin:qwen2",
                          "--policy", str(policy), "--to", "compressed-tensors", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0 and "cannot export as compressed-tensors" in run.stderr
    assert not (tmp_path / "out").exists()


def test_the_cli_writes_a_checkpoint_and_refuses_onnx_options(tmp_path):
    out = tmp_path / "ckpt"
    args = [sys.executable, "-m", "qtransform.cli.main", "export", "builtin:qwen2", "--policy",
            '{"preset": "llm-compressor/FP8_DYNAMIC"}', "--to", "compressed-tensors", "--out", str(out)]
    run = subprocess.run([*args, "--seq-len", "8"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "--seq-len apply to ONNX exports" in run.stderr
    run = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
