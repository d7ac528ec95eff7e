"""`parity --engine vllm --simulate`: the engine side is the trainer policy's checkpoint opened as
vLLM runs it (`qtransform.rl.simulated_engine`), without a vLLM process: its log-probs are those of
`checkpoint_policy(model, engine="vllm")` on the exported folder, and the report's gap is what
the engine's kernels compute differently from the fake quantization."""

from __future__ import annotations

import json

import pytest
import torch

import qtransform
from qtransform.cli.main import main
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model
from qtransform.rl import parity, simulated_engine

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 2, 250, 64]]


def trainer(preset: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return qtransform.transform(build_tiny("qwen2", num_layers=2), {"preset": preset}).eval()


def test_the_engine_is_the_exported_checkpoint_as_vllm_cpu_runs_it(tmp_path):
    model = trainer("llm-compressor/W8A8")
    qtransform.export_checkpoint(model, tmp_path / "ckpt")
    engine = simulated_engine(tmp_path / "ckpt", backend="cpu")
    assert engine.describe().startswith("vllm cpu (simulated)")
    opened = load_model(tmp_path / "ckpt")
    served = qtransform.transform(opened, qtransform.checkpoint_policy(opened, engine="vllm", backend="cpu"))
    prompt, completion = PROMPTS[0][:3], PROMPTS[0][3:]
    with torch.no_grad():
        logits = served(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()
    assert engine.logprobs(prompt, completion) == expected


def test_the_gap_is_the_engines_grid_not_the_formats(tmp_path):
    """W8A8's activations sit on another grid in vLLM CPU (amax / 127, not 127.5): a real gap;
    FP8_DYNAMIC's only differ by where the scale divides: a gap near the fp32 floor."""
    gaps = {}
    for preset in ("llm-compressor/W8A8", "llm-compressor/FP8_DYNAMIC"):
        model = trainer(preset)
        folder = qtransform.export_checkpoint(model, tmp_path / preset.split("/")[1])
        report = parity(model, simulated_engine(folder, backend="cpu"), PROMPTS, max_new_tokens=6,
                        temperature=1.0, attribute=True)
        gaps[preset] = report.mean_abs_delta
        assert report.attribution and report.floor is not None
    assert gaps["llm-compressor/W8A8"] > 1e-3
    assert gaps["llm-compressor/FP8_DYNAMIC"] < gaps["llm-compressor/W8A8"] / 20


def test_the_cli_simulates_a_quantized_folder(tmp_path, capsys):
    model = trainer("llm-compressor/W8A8")
    qtransform.export_checkpoint(model, tmp_path / "ckpt")
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps(qtransform.checkpoint_policy(load_model(tmp_path / "ckpt"))))
    assert main(["parity", str(tmp_path / "ckpt"), "--policy", str(policy), "--engine", "vllm",
                 "--simulate", "--backend", "cpu", "--out", str(tmp_path / "par"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["meta"]["engine"].startswith("vllm cpu (simulated)")
    assert report["meta"]["engine_kind"] == "vllm simulated (cpu)"
    assert report["metrics"]["log_ppl_abs_diff"] > 0


@pytest.mark.parametrize(("args", "words"), [
    (["--engine", "clean", "--simulate"], "--simulate simulates vLLM"),
    (["--backend", "cpu"], "add --simulate"),
])
def test_cli_refusals_are_one_line(tmp_path, capsys, args, words):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"preset": "llm-compressor/W8A8"}))
    assert main(["parity", "builtin:qwen2", "--policy", str(policy), "--out", str(tmp_path / "o"), *args]) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_plain_model_is_refused(tmp_path, capsys):
    build_tiny("qwen2", num_layers=1).save_pretrained(tmp_path / "plain")
    with pytest.raises(UserError, match="not a quantized checkpoint"):
        simulated_engine(tmp_path / "plain")
    noisy = tmp_path / "noisy.json"  # a policy with nothing a checkpoint holds
    noisy.write_text(json.dumps({"noise": {"targets": ["RMSNorm"], "seed": 0, "schedule": {
        "sigma_start": 5e-2, "sigma_end": 1e-3, "num_stages": 4, "total_steps": 8}}}))
    assert main(["parity", "builtin:qwen2", "--policy", str(noisy), "--engine", "vllm", "--simulate",
                 "--out", str(tmp_path / "o")]) != 0
    err = capsys.readouterr().err
    assert "no Linear of the model is quantized" in err and "Traceback" not in err
