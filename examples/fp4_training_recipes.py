"""Does a model survive FP4 training? 200 steps of a small Qwen2 under Transformer Engine's NVFP4
recipe, with and without its random Hadamard transform and stochastic rounding, against plain
training and NVFP4 W4A16 straight-through (the experiment of docs/training.md).

The model is a config-built Qwen2 (2 layers, hidden 128, 0.44M parameters) over bytes (vocabulary
256, no tokenizer), trained from seeded initializations on random 64-byte windows of the
packaged calibration text (qtransform/data/calibration.txt): for each of `--seeds` seeds every run
starts from the same weights and sees the same windows in the same order; AdamW at a constant
learning rate. Runs:

- plain: no quantization;
- w4a16: NVFP4 weights, 16-bit activations, straight-through backward (dX = G·Q(W), dW = Gᵀ·X);
- nvfp4: `transformer-engine/NVFP4BlockScaling` (forward and all three GEMMs in NVFP4);
- nvfp4_no_rht, nvfp4_no_sr, nvfp4_no_rht_no_sr: the same with its switches;
- nvfp4_4over6_fwd: NVFP4 W and X with four over six (Quartet II's forward), straight-through
  backward;
- quartet_ii: `quartet-ii/nvfp4` (that forward, the EDEN backward), Hadamard block 32 (128 does
  not divide the model's 64 key/value features).

Writes `<out>.json` (every run's loss per step and the setup) and `<out>.png` (the loss curves),
each atomically after every run, and prints a Markdown table: the loss averaged over the last 20 steps
(mean, min and max over the seeds) and its difference from plain training of the same seed;
`--replot` redraws the PNG and the table from the JSON.

    nice .venv/bin/python examples/fp4_training_recipes.py --out docs/figures/fp4_training_recipes
    .venv/bin/python examples/fp4_training_recipes.py --steps 20 --runs plain nvfp4   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform
from qtransform.core.io import atomic_path, write_json

NVFP4 = "transformer-engine/NVFP4BlockScaling"
FOUR_OVER_SIX = {"format": "nvfp4", "rounding": "rna", "four_over_six": "mse", "global_bound": 256,
                 "global_scale": "tensor"}
RUNS = {
    "plain": None,
    "w4a16": {"quantize": [{"name": "w4a16", "targets": ["Linear"], "ignore": ["lm_head"],
                            "format": "nvfp4", "tensors": ["weight"]}]},
    "nvfp4": {"preset": NVFP4},
    "nvfp4_no_rht": {"preset": NVFP4, "preset_options": {"disable_rht": True}},
    "nvfp4_no_sr": {"preset": NVFP4, "preset_options": {"disable_stochastic_rounding": True}},
    "nvfp4_no_rht_no_sr": {"preset": NVFP4, "preset_options": {"disable_rht": True,
                                                                "disable_stochastic_rounding": True}},
    "nvfp4_4over6_fwd": {"quantize": [{"name": "nvfp4_4over6_fwd", "targets": ["Linear"],
                                       "ignore": ["lm_head"], "tensors": ["weight", "input"], **FOUR_OVER_SIX}]},
    "quartet_ii": {"preset": "quartet-ii/nvfp4", "preset_options": {"hadamard_dim": 32}},
}
LABELS = {"plain": "none", "w4a16": "NVFP4 weights, straight-through",
          "nvfp4_4over6_fwd": "NVFP4 W and X, four over six (mse, amax to 256, ties away), straight-through"}
TAIL = 20  # steps averaged for the final loss


def build(hidden: int, layers: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).train()


def windows(steps: int, batch: int, length: int, seed: int) -> list[torch.Tensor]:
    """`steps` batches of random byte windows of the calibration text (every run of a seed the same)."""
    text = resources.files("qtransform").joinpath("data/calibration.txt").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(1000 + seed)
    starts = torch.randint(0, len(data) - length, (steps, batch), generator=g)
    return [torch.stack([data[s:s + length] for s in row.tolist()]) for row in starts]


def train(base: torch.nn.Module, policy: dict | None, batches: list[torch.Tensor], lr: float) -> dict:
    model = copy.deepcopy(base)
    if policy is not None:
        model = qtransform.transform(model, {"version": 1, **policy})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, start = [], time.perf_counter()
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"loss": losses, "seconds": time.perf_counter() - start}


def finals(run: dict) -> list[float]:
    """The loss averaged over the last TAIL steps, per seed."""
    return [statistics.fmean(curve[-TAIL:]) for curve in run["loss"]]


def table(result: dict) -> str:
    runs = result["runs"]
    mean = {k: statistics.fmean(finals(r)) for k, r in runs.items()}
    rows = ["| run | policy | loss, last 20 steps: mean (min-max over seeds) | minus plain, same seed: "
            "mean (min-max) | s/step |", "|---|---|---:|---:|---:|"]
    for key, run in runs.items():
        diff = ""
        if "plain" in runs:
            paired = [a - b for a, b in zip(finals(run), finals(runs["plain"]), strict=True)]
            diff = f"{statistics.fmean(paired):+.3f} ({min(paired):+.3f} to {max(paired):+.3f})"
        policy = LABELS.get(key) or json.dumps(RUNS[key])
        low, high = min(finals(run)), max(finals(run))
        steps = sum(len(c) for c in run["loss"])
        rows.append(f"| {key} | `{policy}` | {mean[key]:.3f} ({low:.3f}-{high:.3f}) | {diff} | "
                    f"{run['seconds'] / steps:.2f} |")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ema(values: list[float]) -> list[float]:
        out, level = [], None
        for value in values:
            level = value if level is None else 0.9 * level + 0.1 * value
            out.append(level)
        return out

    runs = result["runs"]
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, run in runs.items():
        loss = [statistics.fmean(values) for values in zip(*run["loss"], strict=True)]
        steps = range(1, len(loss) + 1)
        ax.plot(steps, ema(loss), label=key.replace("_", " "), linewidth=1.4)
        if "plain" in runs:  # the same seed's plain run: initialization and data are shared
            diff = [statistics.fmean(a - b for a, b in zip(ours, plain, strict=True))
                    for ours, plain in zip(zip(*run["loss"], strict=True), zip(*runs["plain"]["loss"], strict=True),
                                           strict=True)]
            dx.plot(steps, ema(diff), label=key.replace("_", " "), linewidth=1.4)
    setup = result["setup"]
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, mean of {setup['seeds']} seeds (EMA 0.9)")
    dx.set_xlabel("step")
    dx.set_ylabel("loss minus plain training of the same seed (EMA 0.9)")
    fig.suptitle(f"Qwen2 {setup['layers']}x{setup['hidden']} ({setup['params_m']:.1f}M), bytes of "
                 f"calibration.txt, batch {setup['batch']}x{setup['length']}, AdamW lr {setup['lr']}",
                 fontsize=10)
    for axis in (ax, dx):
        axis.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, default=3, help="initializations and data orders per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.png")
    ap.add_argument("--replot", action="store_true", help="redraw <out>.png and the table from <out>.json")
    args = ap.parse_args(argv)
    if args.replot:
        if args.out is None:
            ap.error("--replot needs --out")
        result = json.loads(args.out.with_suffix(".json").read_text())
        plot(result, args.out.with_suffix(".png"))
        print(table(result))
        return 0
    torch.set_num_threads(args.threads)
    bases = [build(args.hidden, args.layers, seed) for seed in range(args.seeds)]
    data = [windows(args.steps, args.batch, args.length, seed) for seed in range(args.seeds)]
    setup = {"steps": args.steps, "batch": args.batch, "length": args.length, "hidden": args.hidden,
             "layers": args.layers, "lr": args.lr, "seeds": args.seeds, "torch": torch.__version__,
             "params_m": sum(p.numel() for p in bases[0].parameters()) / 1e6}
    result: dict = {"setup": setup, "runs": {}}
    for key in args.runs:
        runs = [train(base, RUNS[key], batches, args.lr) for base, batches in zip(bases, data, strict=True)]
        result["runs"][key] = {"loss": [r["loss"] for r in runs], "seconds": sum(r["seconds"] for r in runs)}
        print(f"{key}: final loss {finals(result['runs'][key])}", file=sys.stderr)
        if args.out is not None:  # after every run: a long experiment keeps what it has done
            write_json(args.out.with_suffix(".json"), result)
            plot(result, args.out.with_suffix(".png"))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
