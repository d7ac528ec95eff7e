"""Cost of static scales: calibration against one forward pass over the calibration set, and a
W4A4 NVFP4 forward with static activation global scales against dynamic ones (per token, the
default; per tensor), on a Qwen2-shaped model (config-built).

    .venv/bin/python benches/bench_calibration.py [--layers 8] [--hidden 256] [--batches 8]

Every variant is timed in the same run, interleaved round by round; medians are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import qtransform
from qtransform.calibration import calibrate
from qtransform.models import build_tiny

RULE = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "tensors": ["weight", "input"]}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each variant, the variants run round by round (one warm-up round)."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn))
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batches", type=int, default=8, help="calibration batches")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    base = build_tiny("qwen2", num_layers=args.layers, hidden=args.hidden)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(args.batches)]
    static = qtransform.transform(base, {"version": 1, "quantize": [{**RULE, "scale_source": "static"}]},
                                  calibration=data)
    token = qtransform.transform(base, {"version": 1, "quantize": [RULE]})
    tensor = qtransform.transform(base, {"version": 1, "quantize": [{**RULE, "global_scale": "tensor"}]})

    def forward_all(model: torch.nn.Module) -> None:
        with torch.no_grad():
            for b in data:
                model(input_ids=b, use_cache=False)

    head = (f"threads={torch.get_num_threads()} layers={args.layers} hidden={args.hidden} "
            f"calibration={args.batches}x{args.batch}x{args.seq} tokens repeats={args.repeats} "
            f"load average={os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(head)
    cal = interleaved({
        "one forward over the calibration set (original model)": lambda: forward_all(base),
        "calibrate(static W4A4 model, calibration set)": lambda: calibrate(static, data),
    }, args.repeats)
    plain = cal["one forward over the calibration set (original model)"]
    print("| calibration | seconds (median) | ratio |\n|---|---:|---:|")
    for name, sec in cal.items():
        print(f"| {name} | {sec:.3f} | {sec / plain:.3f} |")
    x = data[0]
    fwd = interleaved({
        "W4A4 static global scales": lambda: forward_all_one(static, x),
        "W4A4 dynamic, per token (default)": lambda: forward_all_one(token, x),
        "W4A4 dynamic, per tensor": lambda: forward_all_one(tensor, x),
    }, args.repeats)
    ref = fwd["W4A4 static global scales"]
    print(f"\n| forward ({args.batch}x{args.seq} tokens) | ms (median) | static / this |\n|---|---:|---:|")
    for name, sec in fwd.items():
        print(f"| {name} | {sec * 1e3:.1f} | {ref / sec:.3f} |")


def forward_all_one(model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=x, use_cache=False)


if __name__ == "__main__":
    main()
