"""TRL's generate() path with a correction: GRPOTrainer (use_vllm=False) runs a W4A16 NVFP4 + LoRA +
AQN policy; the rollout log-probs that attach records equal a rollout-phase forward's at the
sampling temperature, and the weights the loss applies equal min(π_trainer / π_rollout, threshold)
computed here token by token from a plain noise-free forward."""

from __future__ import annotations

import math

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.rl import Correction, mismatch_metrics
from tests.tiny_rl import prompts, tiny_qwen2, tiny_tokenizer

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from qtransform.integrations.trl import WEIGHTS, attach  # noqa: E402

SCHEDULE = {"kind": "exponential", "sigma_start": 0.3, "sigma_end": 0.3, "num_stages": 3, "total_steps": 3}
POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "schedule": SCHEDULE, "seed": 5}}  # step 0 clean, then 0.3
TEMPERATURE = 0.7
THRESHOLD = 1.1


def grpo(tmp_path, **config) -> tuple:
    model = qtransform.transform(tiny_qwen2(), POLICY)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=config.pop("max_steps", 2),
        per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        logging_steps=1, learning_rate=1e-2, save_strategy="no", seed=0, temperature=TEMPERATURE,
        bf16=False,  # TRL defaults to bf16 autocast, which generate() and the scoring forward apply differently
        **config,
    )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts(8)}),
        processing_class=tiny_tokenizer(),
        peft_config=peft.LoraConfig(r=4, target_modules="all-linear", lora_alpha=8),
    )
    return model, trainer


class Spy:
    """Calls through, keeping what went in and came out."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, *args):
        out = self.inner(*args)
        self.calls.append((args, out))
        return out


def scored(model, out, rollout_phase: bool) -> torch.Tensor:
    """Log-probs of the completion tokens at the sampling temperature, by a plain forward."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    n = out["completion_ids"].shape[1]
    with torch.no_grad():
        if rollout_phase:
            with qtransform.rollout():
                logits = model(input_ids=ids, attention_mask=attention).logits
        else:
            logits = model(input_ids=ids, attention_mask=attention).logits
    logps = torch.log_softmax(logits[:, -n - 1:-1].float() / TEMPERATURE, dim=-1)
    return logps.gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)


def test_the_loss_applies_truncated_weights_from_the_recorded_rollout_logprobs(tmp_path):
    model, trainer = grpo(tmp_path)
    attach(trainer, correction=Correction(rollout_is="token", rollout_is_threshold=THRESHOLD))
    checks = []

    def check_at_generation(inputs):
        out = scoring(inputs)
        # the weights have not moved yet: score the batch here, independently of TRL and attach
        checks.append((out, scored(trainer.model, out, rollout_phase=False),
                       scored(trainer.model, out, rollout_phase=True)))
        return out

    scoring = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = check_at_generation
    outer = Spy(trainer._compute_loss)  # inputs as TRL buffered them
    trainer._compute_loss = outer
    inner = Spy(outer.inner.original)  # inputs as TRL's loss receives them
    outer.inner.original = inner
    trainer.train()

    assert len(checks) == 2 and len(inner.calls) == 2
    truncated = below = 0
    for out, trainer_lp, rollout_lp in checks:
        mask = out["completion_mask"].bool()
        recorded = out["sampling_per_token_logps"]
        torch.testing.assert_close(recorded[mask], rollout_lp[mask], rtol=0, atol=2e-5)
        torch.testing.assert_close(out["old_per_token_logps"][mask], trainer_lp[mask], rtol=0, atol=2e-5)
        weights = out[WEIGHTS]
        for b, t in mask.nonzero().tolist():
            ratio = math.exp(float(trainer_lp[b, t]) - float(recorded[b, t]))
            assert float(weights[b, t]) == pytest.approx(min(ratio, THRESHOLD), rel=1e-4)
            truncated += ratio > THRESHOLD
            below += ratio < 0.99
        assert not weights[~mask].any()
    assert truncated and below  # the batch exercised both sides of the bound

    for (raw_args, _), (seen_args, _) in zip(outer.calls, inner.calls, strict=True):
        raw, seen = raw_args[1], seen_args[1]
        expected = raw["advantages"].unsqueeze(1) * raw[WEIGHTS]
        assert torch.equal(seen["advantages"], expected)

    rows = [h for h in trainer.state.log_history if "loss" in h]
    for row, (out, _, _) in zip(rows, checks, strict=True):
        expected = mismatch_metrics(out["old_per_token_logps"], out["sampling_per_token_logps"],
                                    out["completion_mask"])
        for key, value in expected.items():
            assert row[f"qtransform/mismatch/{key}"] == pytest.approx(value, rel=1e-9, abs=1e-12)
    assert rows[0]["qtransform/sigma"] == 0.0 and rows[1]["qtransform/sigma"] == pytest.approx(0.3)
    assert rows[1]["qtransform/mismatch/k3_kl"] > 10 * rows[0]["qtransform/mismatch/k3_kl"]


def test_a_correction_on_the_vllm_path_points_to_trls_own(tmp_path):
    _, trainer = grpo(tmp_path)
    trainer.use_vllm = True
    with pytest.raises(UserError, match="vllm_importance_sampling_correction"):
        attach(trainer, correction=Correction())


def test_without_mismatch_metrics_no_trainer_forward_is_added(tmp_path):
    _, trainer = grpo(tmp_path, max_steps=1)
    attach(trainer, mismatch=False)
    forwards = []
    trainer.model.register_forward_hook(lambda m, i, o: forwards.append(torch.is_grad_enabled()))
    trainer.train()
    row = next(h for h in trainer.state.log_history if "loss" in h)
    assert not any(key.startswith("qtransform/mismatch/") for key in row)
    assert forwards == [True]  # the loss forward only (generate() runs the inner model)


def test_trls_own_vllm_ratio_is_not_applied_a_second_time(tmp_path):
    _, trainer = grpo(tmp_path)
    attach(trainer)
    trainer._compute_loss.original = lambda model, inputs: inputs  # see what TRL's loss receives
    advantages = torch.tensor([1.0, -2.0])
    trl_ratio = torch.full((2, 3), 0.5)  # TRL's vLLM correction, applied by TRL itself
    seen = trainer._compute_loss(trainer.model, {"advantages": advantages, "importance_sampling_ratio": trl_ratio})
    assert torch.equal(seen["advantages"], advantages)
    ours = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 0.0]])
    seen = trainer._compute_loss(trainer.model, {"advantages": advantages, WEIGHTS: ours})
    assert torch.equal(seen["advantages"], torch.tensor([[1.0, 0.0, 2.0], [-1.0, -2.0, 0.0]]))
