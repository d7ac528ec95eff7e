"""A GRPO-shaped loop by hand: NVFP4 W4A16 + LoRA + AQN on the rollout only.

Rollouts come from `model.generate()` (a rollout: the norm noise applies at the controller's
sigma); the policy update's log-probs are an ordinary forward (clean); `noise.step()` runs once
per optimizer step. At the end the rollout weights are what an engine would be sent, and the
parity report says how far an engine serving them drifts from the trainer.

    python examples/rl_rollout_loop.py ./Qwen2.5-0.5B-Instruct --steps 50
    python examples/rl_rollout_loop.py --tiny          # a config-built 2-layer Qwen2, seconds
"""

from __future__ import annotations

import argparse

import peft
import torch

import qtransform
from qtransform.models import build_tiny, load_model


def policy(steps: int) -> dict:
    return {
        "version": 1,
        "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
        "noise": {"targets": ["RMSNorm"],  # apply_during "rollout": QeRL's AQN
                  "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 4,
                               "total_steps": steps}},
    }


def reward(completions: torch.Tensor) -> torch.Tensor:
    """A toy reward: how many distinct tokens a completion uses."""
    return torch.tensor([float(len(set(c.tolist()))) for c in completions])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="local Qwen2 folder")
    parser.add_argument("--tiny", action="store_true", help="use a tiny config-built Qwen2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    args = parser.parse_args(argv)
    if not (args.tiny or args.model):
        parser.error("give a model folder or --tiny")
    base = build_tiny("qwen2") if args.tiny else load_model(args.model)
    model = peft.get_peft_model(qtransform.transform(base, policy(args.steps)),
                                peft.LoraConfig(r=8, target_modules="all-linear"))
    noise = qtransform.noise_controller(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(0)
    prompt = torch.randint(2, base.config.vocab_size, (1, 6)).repeat(args.group, 1)
    sigmas = []
    for step in range(args.steps):
        with torch.no_grad():  # rollout: noised norms
            seqs = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=True, pad_token_id=0)
        completions = seqs[:, prompt.shape[1]:]
        rewards = reward(completions)
        advantage = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        model.train()
        logits = model(input_ids=seqs).logits[:, prompt.shape[1] - 1:-1]  # clean
        logp = logits.log_softmax(-1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage.unsqueeze(-1) * logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        sigmas.append(qtransform.core.schedule.sigma_at(noise.current_step, noise.schedule))
        print(f"step {step} reward {rewards.mean():.3f} sigma {sigmas[-1]:g}")
        noise.step()  # once per optimizer step
    weights = dict(qtransform.rollout_weights(model))  # what a sync sends (LoRA merged)
    engine = build_tiny("qwen2") if args.tiny else load_model(args.model)
    engine.load_state_dict(weights)
    report = qtransform.rl.parity(model, qtransform.rl.HFEngine(engine), [prompt[0].tolist()],
                                  max_new_tokens=8)
    print(f"noise: {noise.report()}")
    print(f"parity (trainer vs engine on rollout weights): mean |Δ| {report.mean_abs_delta:.2e}, "
          f"k3 {report.mean_k3:.2e}")
    return {"sigmas": sigmas, "noise": noise.report(), "parity": report, "weights": len(weights)}


if __name__ == "__main__":
    main()
