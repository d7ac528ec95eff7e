"""Cost of `rollout_weights` against a plain `state_dict()` copy, on a 28-layer Qwen2-shaped model.

    .venv/bin/python benches/bench_rollout.py [--hidden 512] [--intermediate N] [--vocab 32000]
                                              [--rounds 15]
                                              [--formats mxfp4,nvfp4] [--dtypes fp32,bf16]
                                              [--fresh-pages]

Both produce every tensor of the model once, as a new tensor (the copy clones each tensor of the
state dict; `rollout_weights` quantizes the linear weights, noises the norms and passes the rest
through). Rounds alternate the copy and the stream; each round's ratio is the stream's time over
the copy's just before it, and the table gives the median of those ratios (adjacent runs share
the machine's state, so a noisy neighbour moves both) and their range, beside the median times.
Peak extra memory is measured as the largest tensor alive at once beyond the model, by tracking
what each stream yields and drops.

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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model(hidden: int, dtype: torch.dtype = torch.float32, intermediate: int | None = None,
          vocab: int = 32000) -> Qwen2ForCausalLM:
    """28 Qwen2 layers (Qwen2.5-1.5B: hidden 1536, intermediate 8960, vocab 151936), built in
    `dtype` (no fp32 copy first)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=intermediate or hidden * 11 // 4,
                      num_hidden_layers=28, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return Qwen2ForCausalLM._from_config(cfg, dtype=dtype).eval()


def consume(pairs) -> tuple[float, int, int]:
    """(seconds, tensors, largest tensor in bytes) for one pass over a stream, keeping nothing."""
    start, n, largest = time.perf_counter(), 0, 0
    for _, tensor in pairs:
        n += 1
        largest = max(largest, tensor.numel() * tensor.element_size())
        del tensor
    return time.perf_counter() - start, n, largest


def measure(dtype: str, fmt: str, args: argparse.Namespace) -> tuple[list[float], list[float], tuple[int, int]]:
    """Per-round seconds of the copy and of the stream, and the stream's (tensors, largest bytes)."""
    policy = {"version": 1,
              "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": fmt}],
              "noise": {"targets": ["RMSNorm"], "schedule": {
                  "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10, "total_steps": 100}}}
    transformed = qtransform.transform(  # in place: the model is the bench's own
        model(args.hidden, DTYPES[dtype], args.intermediate, args.vocab), policy, inplace=True)
    qtransform.noise_controller(transformed).set_step(50)

    def copy():
        return ((k, v.clone()) for k, v in transformed.state_dict().items())

    consume(copy()), consume(qtransform.rollout_weights(transformed))  # warm-up: builds, caches
    copies, streams = [], []
    for _ in range(args.rounds):
        copies.append(consume(copy())[0])
        seconds, n, largest = consume(qtransform.rollout_weights(transformed))
        streams.append(seconds)
    return copies, streams, (n, largest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=None, help="default: hidden * 11 / 4")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--formats", default="mxfp4,nvfp4")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--fresh-pages", action="store_true",
                        help="new pages for every large allocation instead of reused memory")
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = {**os.environ, **(FRESH if args.fresh_pages else REUSE)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    pages = "fresh pages" if args.fresh_pages else "reused memory"
    inter = args.intermediate or args.hidden * 11 // 4
    print(f"28-layer Qwen2 shape, hidden {args.hidden}, intermediate {inter}, vocab {args.vocab}, "
          f"{torch.get_num_threads()} threads, {pages}, "
          f"{args.rounds} rounds, medians")
    print("| dtype, format | state_dict() copy | rollout_weights | ratio | rounds' ratios | tensors "
          "| largest tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        for fmt in args.formats.split(","):
            copies, streams, (n, largest) = measure(dtype, fmt, args)
            ratios = [s / c for s, c in zip(streams, copies, strict=True)]
            print(f"| {dtype}, {fmt} | {statistics.median(copies) * 1e3:.1f} ms | "
                  f"{statistics.median(streams) * 1e3:.1f} ms | **{statistics.median(ratios):.2f}x** | "
                  f"{min(ratios):.2f}-{max(ratios):.2f}x | {n} | "
                  f"{largest / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
