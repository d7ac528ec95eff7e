"""Time fake_quantize for every format against the floor `x * 2.0` on the same tensor and dtype.

One elementwise torch op (allocate the output, read x, write it) is the floor: no fake
quantizer can beat it by much. Targets: on fp32 mxfp4 and nvfp4 within 3x of the
floor and mxfp8 within 2x; on bf16/fp16 (read and written natively) MX formats and int groups
within 1.5x of the same-dtype floor and nvfp4 (which reads the tensor twice) within 1.8x;
stochastic rounding within 3x; NVFP4 four over six (both candidates per block, "mse" and "mae")
within 1.5x of plain nvfp4 on the same dtype. Runs are interleaved (floor, then every case, repeated) so that
load from other processes hits all rows alike; the table shows medians. Every large allocation
gets fresh pages (glibc's mmap threshold is pinned low by re-executing with
MALLOC_MMAP_THRESHOLD_ set), so the floor and the quantizers pay the same page faults.

    .venv/bin/python benches/bench_formats.py                        # fp32 and bf16, 2 threads
    .venv/bin/python benches/bench_formats.py --dtypes fp16 --reference --check
    .venv/bin/python benches/bench_formats.py --memory               # reference path peak memory
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from qtransform.formats import fake_quantize, fastpath, names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TARGETS_FP32 = {"mxfp4": 3.0, "nvfp4": 3.0, "mxfp8_e4m3": 2.0, "mxfp8_e5m2": 2.0}
SR_CASES = ("mxfp4", "nvfp4", "int4")  # stochastic rounding rows (seed 0)
FOS_CASES = {"nvfp4 4over6 mse": "mse", "nvfp4 4over6 mae": "mae"}  # goal: x plain nvfp4
FOS_TARGET = 1.5


def target(case: str, dtype: str) -> float | None:
    """The speed goal of one row against the floor (None: none; four over six's is against
    plain nvfp4, FOS_TARGET)."""
    if case in FOS_CASES:
        return None
    if case.endswith(" sr"):
        return 3.0
    if dtype == "fp32":
        return TARGETS_FP32.get(case)
    if case.startswith("x * 2.0"):
        return None
    return 1.8 if case == "nvfp4" else 1.5


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compile_seconds() -> float | None:
    """Cost of the one-time build of the fast path (into a throwaway cache directory)."""
    old = os.environ.get("QTRANSFORM_CACHE_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["QTRANSFORM_CACHE_DIR"] = tmp
        try:
            start = time.perf_counter()
            built = fastpath.build()
            return time.perf_counter() - start if built else None
        finally:
            if old is None:
                del os.environ["QTRANSFORM_CACHE_DIR"]
            else:
                os.environ["QTRANSFORM_CACHE_DIR"] = old


def cases_for(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    cases: dict[str, Callable[[], object]] = {"x * 2.0 (floor)": lambda: x * 2.0}
    for fmt in names():
        cases[fmt] = lambda fmt=fmt: fake_quantize(x, fmt)
    for fmt in SR_CASES:
        cases[f"{fmt} sr"] = lambda fmt=fmt: fake_quantize(x, fmt, rounding="stochastic", seed=0)
    for key, mode in FOS_CASES.items():
        cases[key] = lambda mode=mode: fake_quantize(x, "nvfp4", four_over_six=mode)
    return cases


def run_dtype(x: torch.Tensor, dtype: str, args: argparse.Namespace) -> list[str]:
    """Time one dtype and print its table; returns the rows that missed their target."""
    cases = cases_for(x)
    for fn in cases.values():
        fn()  # warm up: first-call costs
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.runs):
        for key, fn in cases.items():
            times[key].append(_time(fn))
    ref: dict[str, float] = {}
    if args.reference:
        os.environ["QTRANSFORM_FASTPATH"] = "0"
        for key in cases:
            if key != "x * 2.0 (floor)":
                ref[key] = statistics.median(_time(cases[key]) for _ in range(max(3, args.runs // 2)))
        del os.environ["QTRANSFORM_FASTPATH"]
    floor = statistics.median(times["x * 2.0 (floor)"])
    missed = []
    print(f"\n{dtype}: load average {' '.join(f'{v:.1f}' for v in os.getloadavg())} after the runs")
    print(f"| format ({dtype}) | seconds | x floor | target |{' reference s | ref x floor |' * bool(ref)}")
    print(f"|---|---:|---:|---|{'---:|---:|' * bool(ref)}")
    for key, ts in times.items():
        sec = statistics.median(ts)
        ratio = sec / floor
        goal = target(key, dtype)
        verdict = "" if goal is None else f"<= {goal:g}x {'ok' if ratio <= goal else 'MISSED'}"
        if goal is not None and ratio > goal:
            missed.append(f"{key} ({dtype})")
        if key in FOS_CASES:  # against plain nvfp4: the median of the per-round ratios
            rel = statistics.median(a / b for a, b in zip(ts, times["nvfp4"], strict=True))
            verdict = f"{rel:.2f}x nvfp4 <= {FOS_TARGET:g}x {'ok' if rel <= FOS_TARGET else 'MISSED'}"
            if rel > FOS_TARGET:
                missed.append(f"{key} ({dtype})")
        extra = f" {ref[key]:.4f} | {ref[key] / floor:.1f} |" if key in ref else (" | |" if ref else "")
        print(f"| {key} | {sec:.4f} | {ratio:.2f} | {verdict} |{extra}")
    return missed


_MEMORY_CHILD = """
import resource, sys, torch
from qtransform.formats import fake_quantize
fmt, dtype, n = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3])
x = torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=dtype)
kw = {"rounding": "stochastic", "seed": 0} if len(sys.argv) > 4 else {}
fake_quantize(x[:64], fmt, **kw)  # first-call costs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = fake_quantize(x, fmt, **kw)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (x.numel() * x.element_size()))
"""


def memory(args: argparse.Namespace) -> None:
    """Peak resident memory added by one reference-path fake_quantize, over the tensor's size
    (each case in a fresh process; the output itself is one tensor size of it)."""
    n = args.size
    print(f"\nreference path peak extra memory, {n}x{n}, in tensor sizes (output included)")
    print("| format | dtype | rounding | peak extra / tensor size |\n|---|---|---|---:|")
    env = {**os.environ, "QTRANSFORM_FASTPATH": "0"}
    for fmt, dtype, sr in (("mxfp4", "float32", False), ("nvfp4", "float32", False),
                           ("int4", "float32", False), ("mxfp4", "float32", True),
                           ("mxfp4", "bfloat16", False), ("nvfp4", "bfloat16", True)):
        cmd = [sys.executable, "-c", _MEMORY_CHILD, fmt, dtype, str(n)] + (["sr"] if sr else [])
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        print(f"| {fmt} | {dtype} | {'stochastic' if sr else 'rne'} | {float(res.stdout):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference path")
    ap.add_argument("--memory", action="store_true", help="peak memory of the reference path")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # fresh pages for every large allocation
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.memory:
        memory(args)
        return 0
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    build = compile_seconds()
    start = time.perf_counter()
    lib = fastpath.library()
    load = time.perf_counter() - start
    print(f"torch {torch.__version__}, {args.threads} threads, x: {tuple(x.shape)}, "
          f"median of {args.runs} interleaved runs")
    if lib is None:
        print(f"fast path: UNAVAILABLE ({fastpath.unavailable_reason()}): reference path only")
    else:
        print(f"fast path: first build {build:.2f} s (once per machine), "
              f"load from the cache {load * 1e3:.1f} ms")
    missed = []
    for name in args.dtypes.split(","):
        missed += run_dtype(x.to(DTYPES[name]), name, args)
    if missed:
        print(f"\nmissed: {', '.join(missed)}")
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
