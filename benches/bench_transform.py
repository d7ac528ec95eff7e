"""Benchmarks for capture/transform (the capture and pass pipeline).

Measures, in one run and as ratios:
1. forward time of a W4A16 MXFP4-transformed Qwen2-shaped model against the original model
   (after the first call, weights cached), and the users' earlier approach (forward hooks that
   re-quantize and overwrite `weight.data` on every call, then restore it) for contrast;
2. transform time against depth (2, 8, 28 layers, narrow width): must grow linearly;
3. peak memory of `transform(inplace=True)` against `inplace=False`: no second weight copy.

Run: python benches/bench_transform.py   (2 threads; prints a Markdown table)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

import qtransform
from qtransform.models import build_tiny

POLICY = {"version": 1, "quantize": [
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight"]}]}


def _median_time(fn, repeat: int = 7) -> float:
    return _interleaved([fn], repeat)[0]


def _interleaved(fns, repeat: int) -> list[float]:
    """Median time of each function, timed round by round so load changes hit all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, acc in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _hooked(model):
    """The users' approach: quantize weight.data before each forward, restore it after."""
    saved = {}

    def pre(mod, _inp):
        saved[mod] = mod.weight.data
        mod.weight.data = qtransform.fake_quantize(mod.weight.data, "mxfp4")

    def post(mod, _inp, _out):
        mod.weight.data = saved.pop(mod)

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.register_forward_pre_hook(pre)
            mod.register_forward_hook(post)
    return model


def bench_forward() -> dict:
    model = build_tiny("qwen2", num_layers=4, hidden=512)
    out = qtransform.transform(model, POLICY)
    hooked = _hooked(build_tiny("qwen2", num_layers=4, hidden=512))
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        t_orig, t_q, t_hook = _interleaved(
            [lambda: model(input_ids=ids), lambda: out(input_ids=ids), lambda: hooked(input_ids=ids)], 9)
    return {"original_s": t_orig, "transformed_s": t_q, "hooks_s": t_hook,
            "transformed_ratio": t_q / t_orig, "hooks_ratio": t_hook / t_orig}


def bench_depth() -> dict:
    rows = {}
    for depth in (2, 8, 28):
        model = build_tiny("qwen2", num_layers=depth, hidden=64)
        rows[depth] = _median_time(lambda m=model: qtransform.transform(m, POLICY), repeat=3)
    return {"seconds": rows, "per_layer_s": {d: t / d for d, t in rows.items()}}


_MEMORY_CHILD = """
import json, resource, sys, torch, qtransform
from qtransform.models import build_tiny
torch.set_num_threads(2)
model = build_tiny("qwen2", num_layers=8, hidden=1024)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
qtransform.transform(model, json.loads(sys.argv[2]), inplace=sys.argv[1] == "1")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"weights": weights, "extra_peak": peak - base}))
"""


def bench_memory() -> dict:
    res = {}
    for inplace in (True, False):
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, "1" if inplace else "0", json.dumps(POLICY)],
                             capture_output=True, text=True, check=True)
        res["inplace" if inplace else "copy"] = json.loads(out.stdout)
    return res


def main() -> None:
    torch.set_num_threads(2)
    fwd = bench_forward()
    depth = bench_depth()
    mem = bench_memory()
    mib = 2**20
    print("| measure | value |\n|---|---|")
    print(f"| forward, original (4x128 tokens, 4 layers, width 512) | {fwd['original_s'] * 1e3:.1f} ms |")
    print(f"| forward, W4A16 MXFP4 transformed (cached weights) | {fwd['transformed_s'] * 1e3:.1f} ms "
          f"({fwd['transformed_ratio']:.3f}x) |")
    print(f"| forward, re-quantizing hooks (users' approach) | {fwd['hooks_s'] * 1e3:.1f} ms "
          f"({fwd['hooks_ratio']:.2f}x) |")
    for d, t in depth["seconds"].items():
        print(f"| transform time, {d} layers | {t * 1e3:.0f} ms ({t / d * 1e3:.1f} ms/layer) |")
    for key, r in mem.items():
        print(f"| transform peak extra memory, {key} (weights {r['weights'] / mib:.0f} MiB) | "
              f"{r['extra_peak'] / mib:.0f} MiB ({r['extra_peak'] / r['weights']:.2f}x weights) |")


if __name__ == "__main__":
    main()
