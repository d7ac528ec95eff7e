"""Fine-tune a Qwen2 model under MXFP4 W4A16 fake quantization with QeRL's AQN noise.

The policy quantizes the weights of every Linear except lm_head to MXFP4 (straight-through
gradients reach the full-precision weights) and adds Gaussian noise to the RMSNorm weights on an
exponential schedule. The training loop calls `noise.step()` once per optimizer step; evaluation
runs without noise. At the end the transformed model is saved and reloaded.

    python examples/train_w4a16_aqn.py ./Qwen2.5-0.5B-Instruct --steps 20
    python examples/train_w4a16_aqn.py --tiny          # a config-built 2-layer Qwen2, seconds
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import qtransform
from qtransform.models import build_tiny, load_model, load_tokenizer

TEXT = [
    "Low-precision formats trade accuracy for memory and speed.",
    "Noise on the norm weights makes the model robust to quantization error.",
    "A block of thirty-two values shares one power-of-two scale in MXFP4.",
    "Training with fake quantization keeps the full-precision weights.",
]


def policy(steps: int) -> dict:
    """W4A16 MXFP4 on every Linear but lm_head, AQN on the RMSNorms over `steps` steps."""
    return {
        "version": 1,
        "quantize": [{"name": "w4a16", "targets": ["Linear"], "ignore": ["lm_head"],
                      "format": "mxfp4", "tensors": ["weight"]}],
        "noise": {"targets": ["RMSNorm"], "apply_during": "train",  # the default is "rollout" (RL)
                  "schedule": {"kind": "exponential", "sigma_start": 1e-2, "sigma_end": 1e-4,
                               "num_stages": 5, "total_steps": steps}},
    }


def batches(model: torch.nn.Module, path: str | None) -> list[torch.Tensor]:
    """Token ids of the sample text (random ids for a tiny model without a tokenizer)."""
    tokenizer = load_tokenizer(path) if path else None
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, model.config.vocab_size, (2, 16), generator=g) for _ in range(2)]
    return [tokenizer(TEXT[i:i + 2], return_tensors="pt", padding=True)["input_ids"]
            for i in range(0, len(TEXT), 2)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="local Qwen2 folder (e.g. ./Qwen2.5-0.5B-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="use a tiny config-built Qwen2")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    args = parser.parse_args(argv)
    if not (args.tiny or args.model):
        parser.error("give a model folder or --tiny")
    model = build_tiny("qwen2") if args.tiny else load_model(args.model)
    data = batches(model, None if args.tiny else args.model)

    model = qtransform.transform(model, policy(args.steps)).train()
    noise = qtransform.noise_controller(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        ids = data[step % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sigma = max(noise.sigma().values())
        print(f"step {step:3d}  loss {loss.item():.4f}  sigma {sigma:.2e}")
        noise.step()  # one call per optimizer step

    model.eval()
    with noise.disabled(), torch.no_grad():  # evaluation without noise
        out = model(input_ids=data[0], labels=data[0])
    print(f"eval loss without noise: {out.loss.item():.4f}")

    with tempfile.TemporaryDirectory() as tmp:  # the original weights plus the policy
        qtransform.save_transformed(model, policy(args.steps), tmp)
        reloaded = qtransform.load_transformed(tmp).eval()
        with torch.no_grad():
            same = torch.equal(reloaded(input_ids=data[0]).logits, out.logits)
    print(f"saved and reloaded: same logits = {same}")
    return {"eval_loss": out.loss.item(), "reloaded_identical": same, "steps": args.steps}


if __name__ == "__main__":
    main()
