"""Time one training step (forward, backward, AdamW) of a tiny Qwen2 under each training preset,
against the plain model's step.

Each preset's model comes from `qtransform.transform(copy, {"preset": P})`: the training presets
quantize the forward and, with backward "quantized", every operand of the two backward GEMMs of
every Linear (docs/training.md). Steps of all models are interleaved round by round (the order
rotating), and the table shows medians of wall time and of process CPU time (all threads); the
ratios divide by the plain step measured in the same rounds. Goal: at most 1.5x the plain step.

    .venv/bin/python benches/bench_train_recipes.py                 # fp32, 2 threads
    .venv/bin/python benches/bench_train_recipes.py --hidden 256 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform

PRESETS = {
    "W4A16 straight-through": {"quantize": [{"name": "w4a16", "targets": ["Linear"], "ignore": ["lm_head"],
                                             "format": "nvfp4", "tensors": ["weight"]}]},
    "transformer-engine/NVFP4BlockScaling": {"preset": "transformer-engine/NVFP4BlockScaling"},
    "NVFP4BlockScaling, no RHT, no SR": {"preset": "transformer-engine/NVFP4BlockScaling",
                                         "preset_options": {"disable_rht": True,
                                                            "disable_stochastic_rounding": True}},
    "transformer-engine/MXFP8BlockScaling": {"preset": "transformer-engine/MXFP8BlockScaling"},
    "torchao/MXFP8_RCEIL": {"preset": "torchao/MXFP8_RCEIL"},
}


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).train()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="preset keys to time (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = build(args)
    models = {"plain": plain}
    for key, policy in PRESETS.items():
        if args.only is None or key in args.only:
            models[key] = qtransform.transform(copy.deepcopy(plain), {"version": 1, **policy}).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(key: str) -> tuple[float, float]:
        model, opt = models[key], opts[key]
        start, cpu = time.perf_counter(), time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu

    for key in models:  # warm up: allocator, optimizer state
        step(key)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    keys = list(models)
    for r in range(args.rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(step(key))
    params = sum(p.numel() for p in plain.parameters())
    wall = {k: statistics.median(t[0] for t in ts) for k, ts in times.items()}
    cpu = {k: statistics.median(t[1] for t in ts) for k, ts in times.items()}
    print(f"torch {torch.__version__}, {args.threads} threads, Qwen2 shape: {args.layers} layers, "
          f"hidden {args.hidden}, vocab {args.vocab}, {params / 1e6:.1f}M params, fp32, "
          f"batch {args.batch}x{args.seq} tokens, median of {args.rounds} interleaved rounds; "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("\n| training step | wall ms (median) | ratio | CPU ms (median) | ratio |\n|---|---:|---:|---:|---:|")
    for key in models:
        print(f"| {key} | {wall[key] * 1e3:.1f} | {wall[key] / wall['plain']:.2f} | "
              f"{cpu[key] * 1e3:.1f} | {cpu[key] / cpu['plain']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
