"""Time rotated fake quantization against the plain one, as ratios interleaved in one process.

Goals (issue 31, 2 cores): the MXFP4 fake quantization of a rotated 4096x4096 weight at most 2x
the plain MXFP4 fake quantization of the same weight, and a rotated W4A4 forward at most 1.2x
the unrotated W4A4 forward. The weight of a rotated Linear is rotated and quantized once per
weight version (cached), so the rotated forward pays only the online rotation of its
activations: the forward rows time a 4096x4096 MXFP4 W4A4 linear on `--tokens` tokens with its
quantized weight precomputed, the input quantized (after a 32-wide random Hadamard rotation in
the rotated row). Every case runs once per round, rounds repeated `--runs` times; the table
shows medians and their ratio to the row's baseline. Every large allocation gets fresh pages
(glibc's mmap threshold pinned low by re-executing with MALLOC_MMAP_THRESHOLD_ set), so all rows
pay the same page faults, as in bench_formats.py.

    .venv/bin/python benches/bench_rotate.py                 # 2 threads, 4096, 512 tokens
    .venv/bin/python benches/bench_rotate.py --block 4096    # a whole-axis rotation
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qtransform.formats import fake_quantize, fastpath
from qtransform.formats import hadamard as H

GOALS = {"weight": 2.0, "forward": 1.2}


def cases(args: argparse.Namespace) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (group, function); the first case of each group is its baseline."""
    g = torch.Generator().manual_seed(0)
    n, b = args.size, args.block
    w = torch.randn(n, n, generator=g) * 0.02
    x = torch.randn(args.tokens, n, generator=g)
    signs = H.random_signs(b, 0)
    wq = fake_quantize(w, "mxfp4")
    wq_rot = H.rotate_fake_quantize(w, b, signs, "mxfp4")  # once per weight version
    return {
        "mxfp4 fake quant (plain)": ("weight", lambda: fake_quantize(w, "mxfp4")),
        f"rotate_fake_quantize (fwht {b} + mxfp4, fused)": (
            "weight", lambda: H.rotate_fake_quantize(w, b, signs, "mxfp4")),
        f"fwht {b} alone": ("weight", lambda: H.fwht(w, b, signs)),
        f"dense rotate {b} + mxfp4 (reference)": (
            "weight", lambda: fake_quantize(H.rotate(w, b, signs), "mxfp4")),
        "W4A4 forward (unrotated)": ("forward", lambda: F.linear(fake_quantize(x, "mxfp4"), wq)),
        f"W4A4 forward (input rotated, fwht {b})": (
            "forward", lambda: F.linear(H.rotate_fake_quantize(x, b, signs, "mxfp4"), wq_rot)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # fresh pages for every large allocation
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    torch.set_num_threads(args.threads)
    if fastpath.unavailable_reason():
        print(f"note: the compiled kernel is not used: {fastpath.unavailable_reason()}")
    table = cases(args)
    times: dict[str, list[float]] = {k: [] for k in table}
    with torch.inference_mode():
        for _, fn in table.values():
            fn()  # first-call costs
        for _ in range(args.runs):
            for key, (_, fn) in table.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
    print(f"{args.size}x{args.size} fp32, {args.tokens} tokens, block {args.block}, "
          f"{args.threads} threads, median of {args.runs}; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())} after the runs")
    print("| case | ms (median) | x baseline | goal |\n|---|---:|---:|---|")
    missed = []
    baseline: dict[str, float] = {}
    for key, (group, _) in table.items():
        ms = 1000 * statistics.median(times[key])
        base = baseline.setdefault(group, ms)
        ratio = ms / base
        goal = ""
        if ms != base and ("fused" in key or "rotated" in key):
            ok = ratio <= GOALS[group]
            goal = f"<= {GOALS[group]:g}x {'ok' if ok else 'MISSED'}"
            if not ok:
                missed.append(key)
        print(f"| {key} | {ms:.1f} | {ratio:.2f} | {goal} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
