"""Cost of `rollout_weights` against a plain `state_dict()` copy, on a 28-layer Qwen2-shaped model.

    .venv/bin/python benches/bench_rollout.py [--hidden 512] [--rounds 5] [--format nvfp4]
                                              [--dtype fp32|bf16] [--fresh-pages]

Both produce every tensor of the model once, as a new tensor (the copy clones each tensor of the
state dict; `rollout_weights` quantizes the linear weights, noises the norms and passes the rest
through). Rounds are interleaved and the median is reported; peak extra memory is measured as the
largest tensor alive at once beyond the model, by tracking what each stream yields and drops.

The allocator is pinned (the script re-executes itself with glibc's malloc settings), because on
a VM a page fault costs about a microsecond and unpinned runs swing between the two regimes: by
default freed memory is reused, as in a trainer's steady state (the copy's fastest case, so the
ratio is the conservative one); `--fresh-pages` gives every large allocation new pages instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform

REUSE = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
FRESH = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def model(hidden: int, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=28, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def consume(pairs) -> tuple[float, int, int]:
    """(seconds, tensors, largest tensor in bytes) for one pass over a stream, keeping nothing."""
    start, n, largest = time.perf_counter(), 0, 0
    for _, tensor in pairs:
        n += 1
        largest = max(largest, tensor.numel() * tensor.element_size())
        del tensor
    return time.perf_counter() - start, n, largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--fresh-pages", action="store_true",
                        help="new pages for every large allocation instead of reused memory")
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = {**os.environ, **(FRESH if args.fresh_pages else REUSE)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    policy = {"version": 1,
              "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": args.format}],
              "noise": {"targets": ["RMSNorm"], "schedule": {
                  "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10, "total_steps": 100}}}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    transformed = qtransform.transform(model(args.hidden, dtype), policy)
    qtransform.noise_controller(transformed).set_step(50)
    params = sum(t.numel() for t in transformed.state_dict().values())

    def copy():
        return ((k, v.clone()) for k, v in transformed.state_dict().items())

    results: dict[str, list[float]] = {"state_dict() copy": [], "rollout_weights": []}
    shape = {}
    for _ in range(args.rounds):
        for label, make in (("state_dict() copy", copy),
                            ("rollout_weights", lambda: qtransform.rollout_weights(transformed))):
            seconds, n, largest = consume(make())
            results[label].append(seconds)
            shape[label] = (n, largest)
    base = statistics.median(results["state_dict() copy"])
    pages = "fresh pages" if args.fresh_pages else "reused memory"
    print(f"28-layer Qwen2 shape, hidden {args.hidden}, {params / 1e6:.1f}M values, {args.dtype}, "
          f"{args.format}, {torch.get_num_threads()} threads, {pages}, median of {args.rounds} "
          "interleaved rounds")
    print("| stream | tensors | median time | ratio | largest tensor |")
    print("|---|---|---|---|---|")
    for label, times in results.items():
        n, largest = shape[label]
        med = statistics.median(times)
        print(f"| {label} | {n} | {med * 1e3:.0f} ms | {med / base:.2f}x | {largest / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
