"""The parity report: an engine that serves the rollout weights has no gap, one given the clean
weights shows it, and the statistics match a hand-worked case (an engine whose log-probs are the
trainer's shifted by a constant, scored by a plain model with torch's log_softmax)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import qtransform
from qtransform.cli.main import main
from qtransform.rl import HFEngine, parity
from tests.tiny_rl import tiny_qwen2

POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "seed": 3,
                    "schedule": {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005,
                                 "num_stages": 4, "total_steps": 40}}}
PROMPTS = [[5, 17, 33, 8], [90, 4, 61, 22, 7]]


def transformed(step: int = 12) -> torch.nn.Module:
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(step)
    return model


def test_an_engine_with_the_rollout_weights_has_no_gap_and_a_clean_one_shows_it(tmp_path):
    model = transformed()
    served = tiny_qwen2(seed=7)
    served.load_state_dict(dict(qtransform.rollout_weights(model)))
    same = parity(model, HFEngine(served), PROMPTS, max_new_tokens=6, phase="rollout")
    assert same.max_abs_delta == 0.0 and same.greedy_agreement == 1.0 and same.k1 == [0.0, 0.0]
    assert same.tokens == 12

    gap = parity(model, HFEngine(tiny_qwen2()), PROMPTS, max_new_tokens=6, phase="rollout")
    assert gap.max_abs_delta > 1e-3 and gap.mean_k3 > 0
    assert gap.largest[0]["delta"] == pytest.approx(max((d for s in gap.deltas for d in s), key=abs))
    # in the train phase the trainer is clean: the served rollout differs by AQN's noise alone
    train = parity(model, HFEngine(served), PROMPTS, max_new_tokens=6, phase="train")
    assert train.max_abs_delta > 0

    paths = gap.write(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["max_abs_delta"] == gap.max_abs_delta and len(data["largest"]) == 10
    assert "| sequence | position | token |" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_of_a_constant_shift():
    model = transformed(step=0)  # noise-free: the plain reference below scores the same weights
    plain = tiny_qwen2()
    plain.load_state_dict(dict(qtransform.rollout_weights(model)))
    shift = 0.125

    def engine(prompt: list[int], completion: list[int]) -> list[float]:
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + completion])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        return [float(lp[len(prompt) - 1 + i, t]) + shift for i, t in enumerate(completion)]

    completions = [[9, 10, 11], [12, 13, 14, 15]]
    report = parity(model, engine, PROMPTS, completions)
    assert report.tokens == 7 and report.greedy_agreement is None
    assert report.mean_abs_delta == pytest.approx(shift, abs=1e-6)
    assert report.k1 == pytest.approx([3 * shift, 4 * shift], abs=1e-5)
    k3 = math.exp(-shift) - 1 + shift  # exp(r) - 1 - r with r = lp_trainer - lp_engine = -shift
    assert report.k3 == pytest.approx([3 * k3, 4 * k3], rel=1e-4)


def test_parity_cli(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    args = ["parity", "builtin:qwen2", "--policy", str(policy), "--step", "12",
            "--max-new-tokens", "4", "--num-prompts", "2", "--phase", "rollout"]
    assert main([*args, "--engine", "rollout-weights", "--out", str(tmp_path / "same")]) == 0
    assert json.loads((tmp_path / "same" / "parity.json").read_text())["max_abs_delta"] == 0.0
    assert main([*args, "--engine", "clean", "--out", str(tmp_path / "gap")]) == 0
    gap = json.loads((tmp_path / "gap" / "parity.json").read_text())
    assert gap["max_abs_delta"] > 1e-3 and (tmp_path / "gap" / "parity.png").exists()
    assert "greedy agreement" in capsys.readouterr().out
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x")
    assert main([*args, "--out", str(foreign)]) == 2  # a folder qtransform did not write
    assert (foreign / "mine.txt").read_text() == "x"
