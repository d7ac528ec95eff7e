"""The export's engine report (`qtransform.engine_differences`): what vLLM computes differently
from the fake-quantized model, backend by backend, from the same homes as the simulation, so each
line marked simulated is a difference `checkpoint_policy(engine="vllm")` computes."""

from __future__ import annotations

import json

import pytest
import torch

import qtransform
from qtransform.cli.main import main
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model

CALIB = [torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_report")
    model = build_tiny("qwen2", num_layers=1)
    out = {}
    for name, presets in {"W8A8": ["llm-compressor/W8A8"],
                          "FP8_KV": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"],
                          "NVFP4": ["llm-compressor/NVFP4"]}.items():
        qtransform.export_checkpoint(model, root / name, policy={"preset": presets}, calibration=CALIB)
        out[name] = root / name
    qtransform.export_checkpoint(model, root / "MO_NVFP4_KV", format="modelopt", calibration=CALIB,
                                 policy={"preset": ["modelopt/NVFP4_DEFAULT_CFG", "modelopt/NVFP4_KV_CFG"]})
    out["MO_NVFP4_KV"] = root / "MO_NVFP4_KV"
    return out


def test_w8a8_names_the_cpu_grid_and_the_gpu_kernel(folders):
    report = qtransform.engine_differences(folders["W8A8"])
    assert list(report) == ["cpu", "flash-attn-3", "triton"]
    [cpu] = report["cpu"]
    assert "amax / 127 in fp32" in cpu and "127.5" in cpu and cpu.endswith("(simulated)")
    [gpu] = report["triton"]
    assert "CUTLASS" in gpu and "not simulated" in gpu
    # the same answer from the opened model as from the folder
    assert qtransform.engine_differences(load_model(folders["W8A8"])) == report


def test_the_kv_lines_are_the_fields_the_engine_policy_changes(folders):
    report = qtransform.engine_differences(folders["FP8_KV"], backends=("cpu", "flash-attn-3"))
    cpu = [line for line in report["cpu"] if line.startswith("KV cache")]
    assert "fp8_variant default → vllm-cpu" in cpu[0] and "rounding rne → rtz" in cpu[0]
    assert "vLLM's CPU attention" in cpu[1]
    fa3 = [line for line in report["flash-attn-3"] if line.startswith("KV cache")]
    assert "rounding" not in fa3[0]  # FA3's writer rounds to nearest even, as the producer
    assert any("query is quantized" in line for line in fa3)
    # every field named is one the engine policy really sets
    model = load_model(folders["FP8_KV"])
    rule = next(r for r in qtransform.checkpoint_policy(model, engine="vllm", backend="cpu")["quantize"]
                if r["tensors"] == ["key", "value"])
    assert (rule["fp8_variant"], rule["rounding"]) == ("vllm-cpu", "rtz")


def test_what_a_backend_does_not_run_says_so_in_its_line(folders):
    report = qtransform.engine_differences(folders["NVFP4"], backends=("cpu", "flash-attn-3"))
    assert "not simulated" in report["cpu"][0] and "does not run this scheme" in report["cpu"][0]
    assert "Marlin" in report["flash-attn-3"][0]
    kv = qtransform.engine_differences(folders["MO_NVFP4_KV"], backends=("cpu", "triton"))
    for backend in ("cpu", "triton"):
        assert any("FlashInfer only" in line and "not simulated" in line for line in kv[backend])
    readers = qtransform.engine_differences(folders["MO_NVFP4_KV"])  # FlashInfer's, by default
    assert sorted(readers) == ["flashinfer", "flashinfer-xqa", "trtllm-gen"]
    assert any("FA2 template" in line and "(simulated from source)" in line for line in readers["flashinfer"])
    assert any("its steps inside inferred" in line for line in readers["trtllm-gen"])


def test_bad_requests_are_one_line(folders, tmp_path):
    with pytest.raises(UserError, match="choose among cpu"):
        qtransform.engine_differences(folders["W8A8"], backends=("cuda",))
    plain = tmp_path / "plain"
    build_tiny("qwen2", num_layers=1).save_pretrained(plain)
    with pytest.raises(UserError, match="not a quantized checkpoint"):
        qtransform.engine_differences(plain)


def test_the_export_cli_prints_and_records_it(tmp_path, capsys):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"preset": "llm-compressor/W8A8"}))
    assert main(["export", "builtin:qwen2", "--policy", str(policy), "--to", "compressed-tensors",
                 "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "cpu: Linears with weights int8 per channel" in text and "amax / 127 in fp32" in text
    assert main(["export", "builtin:qwen2", "--policy", str(policy), "--to", "compressed-tensors",
                 "--out", str(tmp_path / "out2"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine_differences"]["vllm"] == qtransform.engine_differences(tmp_path / "out2")
