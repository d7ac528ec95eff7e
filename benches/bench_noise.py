"""Cost of AQN and hardware-error noise: one forward against the same model without noise, and
one `controller.step()`, on a 28-layer Qwen2-shaped model (narrow, config-built).

    OMP_NUM_THREADS=1 .venv/bin/python benches/bench_noise.py [--device cuda] [--hidden 256]

Every variant is timed in the same run, interleaved round by round, and the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import qtransform
from qtransform.models import build_tiny

SCHEDULE = {"sigma_start": 0.01, "sigma_end": 0.0001, "num_stages": 10, "total_steps": 1000}


def policies() -> dict[str, dict | None]:
    noise = {"schedule": SCHEDULE, "apply_during": "both"}
    return {
        "no noise (original model)": None,
        "AQN inserted, inactive (apply_during=train, eval mode)": {
            "version": 1, "noise": {**noise, "apply_during": "train"}},
        "AQN on all norms, resample=step": {"version": 1, "noise": noise},
        "AQN on all norms, resample=forward": {"version": 1, "noise": {**noise, "resample": "forward"}},
        "hw_error relative, all linear outputs": {"version": 1, "hw_error": {"error_scale": 0.05}},
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    base = build_tiny("qwen2", num_layers=args.layers, hidden=args.hidden).to(device)
    models = {name: base if p is None else qtransform.transform(base, p) for name, p in policies().items()}
    for name, model in models.items():
        if name.startswith("AQN"):
            qtransform.noise_controller(model).set_step(SCHEDULE["total_steps"] // 2)
    x = torch.randint(0, 256, (args.batch, args.seq), device=device)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():  # warm-up
            model(input_ids=x)
        for _ in range(args.repeats):
            for name, model in models.items():
                times[name].append(timed(lambda m=model: m(input_ids=x), device))
    plain = statistics.median(times["no noise (original model)"])
    print(f"device={device} threads={torch.get_num_threads()} layers={args.layers} hidden={args.hidden} "
          f"tokens={args.batch}x{args.seq} repeats={args.repeats} "
          f"load average={os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print("| variant | forward ms (median) | ratio |\n|---|---:|---:|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med * 1e3:.2f} | {med / plain:.3f} |")
    controller = qtransform.noise_controller(models["AQN on all norms, resample=step"])
    steps = [timed(controller.step, device) for _ in range(max(args.repeats, 5) * 10)]
    print(f"\ncontroller.step() over {len(controller.modules)} AQN sites: "
          f"median {statistics.median(steps) * 1e6:.0f} us ({len(steps)} calls)")


if __name__ == "__main__":
    main()
