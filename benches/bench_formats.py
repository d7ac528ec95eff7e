"""Time fake_quantize for every format against the floor `x * 2.0` on the same tensor.

One elementwise torch op (allocate the output, read x, write it) is the floor: no fake
quantizer can beat it by much. Targets: mxfp4 and nvfp4 within 3x of the floor, mxfp8 within 2x.
Runs are interleaved (floor, then every format, repeated) so that load from other processes hits
all rows alike; the table shows medians.

    .venv/bin/python benches/bench_formats.py            # 4096x4096 fp32, 2 threads, 7 runs
    .venv/bin/python benches/bench_formats.py --reference --check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from qtransform.formats import fake_quantize, fastpath, names

TARGETS = {"mxfp4": 3.0, "nvfp4": 3.0, "mxfp8_e4m3": 2.0, "mxfp8_e5m2": 2.0}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", action="store_true", help="also time the torch reference path")
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))

    build = compile_seconds()
    start = time.perf_counter()
    lib = fastpath.library()
    load = time.perf_counter() - start
    print(f"torch {torch.__version__}, {args.threads} threads, x: {tuple(x.shape)} fp32, "
          f"median of {args.runs} runs")
    if lib is None:
        print("fast path: UNAVAILABLE (no C compiler or build failed): reference path only")
    else:
        print(f"fast path: first build {build:.2f} s (once per machine), "
              f"load from the cache {load * 1e3:.1f} ms")

    cases: dict[str, Callable[[], object]] = {"x * 2.0 (floor)": lambda: x * 2.0}
    for fmt in names():
        cases[fmt] = lambda fmt=fmt: fake_quantize(x, fmt)
    for fn in cases.values():
        fn()  # warm up: allocator, first-call costs
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.runs):
        for key, fn in cases.items():
            times[key].append(_time(fn))
    ref: dict[str, float] = {}
    if args.reference:
        os.environ["QTRANSFORM_FASTPATH"] = "0"
        for fmt in names():
            ref[fmt] = statistics.median(_time(cases[fmt]) for _ in range(max(3, args.runs // 2)))
        del os.environ["QTRANSFORM_FASTPATH"]

    floor = statistics.median(times["x * 2.0 (floor)"])
    missed = []
    print(f"\n| format | seconds | x floor | target |{' reference s | ref x floor |' * bool(ref)}")
    print(f"|---|---|---|---|{'---|---|' * bool(ref)}")
    for key, ts in times.items():
        sec = statistics.median(ts)
        ratio = sec / floor
        target = TARGETS.get(key)
        verdict = "" if target is None else f"<= {target:g}x {'ok' if ratio <= target else 'MISSED'}"
        if target is not None and ratio > target:
            missed.append(key)
        extra = f" {ref[key]:.4f} | {ref[key] / floor:.1f} |" if key in ref else (
            " | |" if ref else "")
        print(f"| {key} | {sec:.4f} | {ratio:.2f} | {verdict} |{extra}")
    if missed:
        print(f"\nmissed: {', '.join(missed)}")
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
