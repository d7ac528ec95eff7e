"""`format="modelopt"` against ModelOpt 0.47's own `export_hf_checkpoint` of the same tiny Qwen2
with the same calibration (tests/data/modelopt-export.safetensors, written by
tests/data/make_modelopt_export.py in an environment with ModelOpt: its export runs on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import qtransform
from qtransform.models import build_tiny
from tests.export.test_checkpoint import E2M1, read

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "modelopt-export.safetensors"
FP8_EXPORT_ORDER = [{"name": f"modelopt/FP8_DEFAULT_CFG {part}", "fp8_variant": "default"}
                    for part in ("weights", "inputs")]


def golden(tag: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
        return ({k.removeprefix(tag + "."): f.get_tensor(k) for k in f.keys() if k.startswith(tag + ".")},  # noqa: SIM118
                meta)


def export(policy: dict, tmp_path):
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    model = qtransform.transform(build_tiny("qwen2"), policy, calibration=list(calib.split(2)))
    qtransform.export_checkpoint(model, tmp_path / "out", format="modelopt")
    return model, read(tmp_path / "out")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize(("tag", "policy"), [
    ("nvfp4", {"preset": "modelopt/NVFP4_DEFAULT_CFG"}),
    ("fp8", {"preset": "modelopt/FP8_DEFAULT_CFG", "quantize": FP8_EXPORT_ORDER}),
])
def test_byte_identical_to_modelopts_own_export(tag, policy, tmp_path):
    _, ours = export(policy, tmp_path)
    theirs, meta = golden(tag)
    assert theirs and all(k in ours for k in theirs)
    for name, tensor in theirs.items():
        assert same_bytes(ours[name], tensor), name
    folder = tmp_path / "out"
    assert json.loads((folder / "hf_quant_config.json").read_text()) == json.loads(meta[f"{tag}.hf_quant_config"])
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == json.loads(meta[f"{tag}.quantization_config"])


def test_nvfp4_decodes_to_the_fake_quant_weights(tmp_path):
    model, ours = export({"preset": "modelopt/NVFP4_DEFAULT_CFG"}, tmp_path)
    for name, module in model.named_modules():
        fq = getattr(module, "weight_fake_quant", None)
        if fq is None:
            continue
        packed = ours[f"{name}.weight"]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
        q = torch.where(codes >= 8, -E2M1[codes & 7], E2M1[codes & 7])
        scale = ours[f"{name}.weight_scale"].float() * ours[f"{name}.weight_scale_2"]
        got = q * scale.repeat_interleave(16, dim=1)
        assert torch.equal(got, fq.quantized_copy(module.weight)), name


def test_the_fp8_preset_stores_what_it_computes(tmp_path):
    """ModelOpt's fake quantization scales by fl(1 / fl(448 / amax)), its export by amax / 448:
    the preset reproduces the former, and its checkpoint decodes to it (ModelOpt's own export
    differs from its own model by one ulp in some scales)."""
    model, ours = export({"preset": "modelopt/FP8_DEFAULT_CFG"}, tmp_path)
    theirs, _ = golden("fp8")
    ulps = 0
    for name, module in model.named_modules():
        fq = getattr(module, "weight_fake_quant", None)
        if fq is None:
            continue
        got = ours[f"{name}.weight"].float() * ours[f"{name}.weight_scale"]
        assert torch.equal(got, fq.quantized_copy(module.weight)), name
        a, b = ours[f"{name}.weight_scale"], theirs[f"{name}.weight_scale"]
        ulps += not torch.equal(a, b)
        assert abs(a.view(torch.int32).item() - b.view(torch.int32).item()) <= 1
    assert ulps > 0  # the two orders do differ on this model


def test_refusals(tmp_path):
    model = qtransform.transform(build_tiny("qwen2"), {"preset": "llm-compressor/NVFP4A16"})
    with pytest.raises(qtransform.UserError, match="nvfp4_variant 'compressed-tensors'.*ModelOpt"):
        qtransform.export_checkpoint(model, tmp_path / "out", format="modelopt")
    model = qtransform.transform(build_tiny("qwen2", hidden=128), {"preset": "llm-compressor/W4A16"})
    with pytest.raises(qtransform.UserError, match="format int4 has no ModelOpt form"):
        qtransform.export_checkpoint(model, tmp_path / "out", format="modelopt")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4"])
def test_a_weight_only_nvfp4_checkpoint_opens_without_an_input_rule(algo, tmp_path):
    """NVFP4 weights with 16-bit inputs: no input_scale in the folder, so the opened policy
    quantizes no inputs, whether hf_quant_config says NVFP4 (qtransform's writer) or
    W4A16_NVFP4 (ModelOpt's name for it); the logits are the transformed model's bit for bit."""
    from qtransform.models import checkpoint_policy, load_model

    rule = {"targets": ["Linear"], "ignore": ["lm_head"], "tensors": ["weight"], "format": "nvfp4",
            "nvfp4_variant": "modelopt", "share_scale": "fused"}
    model, tensors = export({"quantize": [rule]}, tmp_path)
    assert not [k for k in tensors if k.endswith("input_scale")]
    config = tmp_path / "out" / "hf_quant_config.json"
    data = json.loads(config.read_text())
    assert data["quantization"]["quant_algo"] == "NVFP4"
    data["quantization"]["quant_algo"] = algo
    config.write_text(json.dumps(data))
    opened = load_model(tmp_path / "out")
    policy = checkpoint_policy(opened)
    assert [r for r in policy["quantize"] if "input" in r["tensors"]] == []
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(qtransform.transform(opened, policy)(ids).logits, model(ids).logits)


def test_input_scales_on_some_linears_only_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from qtransform.models import load_model

    export({"preset": "modelopt/NVFP4_DEFAULT_CFG"}, tmp_path)
    file = next((tmp_path / "out").glob("*.safetensors"))
    tensors = load_file(str(file))
    dropped = "model.layers.0.mlp.down_proj.input_scale"
    del tensors[dropped]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(qtransform.UserError, match="input_scale on .* but not on model.layers.0.mlp.down_proj"):
        load_model(tmp_path / "out")
