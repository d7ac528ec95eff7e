"""Time one W4A16 training step (forward, backward, AdamW) against the original model's.

A Qwen2-shaped model built from a transformers `Qwen2Config` with seeded weights; the W4A16
copy comes from `qtransform.transform(model, policy)` (every Linear weight but lm_head fake-
quantized, straight-through gradient). The weights change every step, so each quantized weight
must be quantized exactly once per step: the script counts the quantizations and fails if not.
Steps of the two models are interleaved round by round (the order alternating), and the table
shows medians of wall time and of process CPU time (all threads): on a shared machine the CPU
time is the steadier of the two, since waiting for a core costs wall time only.

    .venv/bin/python benches/bench_train_step.py                 # mxfp4, fp32, 2 threads
    .venv/bin/python benches/bench_train_step.py --format nvfp4 --dtype bf16
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
from qtransform import formats

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(DTYPES[args.dtype]).train()


class Counter:
    """Counts fake_quantize calls (the pass calls it through `qtransform.formats`)."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = formats.fake_quantize

    def __enter__(self) -> Counter:
        def counted(*a, **k):
            self.calls += 1
            return self._orig(*a, **k)

        formats.fake_quantize = counted
        return self

    def __exit__(self, *exc: object) -> None:
        formats.fake_quantize = self._orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    original = build(args)
    policy = {"version": 1, "quantize": [{"name": "w4a16", "targets": ["Linear"], "ignore": ["lm_head"],
                                          "format": args.format, "tensors": ["weight"]}]}
    quantized = qtransform.transform(copy.deepcopy(original), policy).train()
    n_weights = sum(1 for m in quantized.modules() if type(m).__name__ == "FakeQuantize")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    models = {"original": original, "W4A16": quantized}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}

    def step(key: str) -> tuple[float, float]:
        model, opt = models[key], opts[key]
        start, cpu = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - cpu

    for key in models:  # warm up: allocator, optimizer state
        step(key)
        step(key)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in models}
    per_step: list[int] = []
    for r in range(args.rounds):
        for key in (list(models) if r % 2 == 0 else list(models)[::-1]):
            if key == "W4A16":
                with Counter() as c:
                    times[key].append(step(key))
                per_step.append(c.calls)
            else:
                times[key].append(step(key))
    params = sum(p.numel() for p in original.parameters())
    wall = {k: statistics.median(t[0] for t in ts) for k, ts in times.items()}
    cpu = {k: statistics.median(t[1] for t in ts) for k, ts in times.items()}
    print(f"torch {torch.__version__}, {args.threads} threads, Qwen2 shape: {args.layers} layers, "
          f"hidden {args.hidden}, vocab {args.vocab}, {params / 1e6:.1f}M params, {args.dtype}, "
          f"batch {args.batch}x{args.seq} tokens, {args.format} on {n_weights} Linear weights, "
          f"median of {args.rounds} interleaved rounds; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("\n| model | wall ms (median) | ratio | CPU ms (median) | ratio |\n|---|---:|---:|---:|---:|")
    for key in models:
        print(f"| {key} | {wall[key] * 1e3:.1f} | {wall[key] / wall['original']:.3f} | "
              f"{cpu[key] * 1e3:.1f} | {cpu[key] / cpu['original']:.3f} |")
    print(f"\nquantizations per step: {sorted(set(per_step))} for {n_weights} quantized weights")
    if set(per_step) != {n_weights}:
        print("FAILED: every quantized weight must be quantized exactly once per step")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
