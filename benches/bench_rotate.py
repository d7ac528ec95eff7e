"""Time rotated fake quantization against the plain one, as ratios interleaved in one process.

Goals (2 cores): the MXFP4 fake quantization of a rotated 4096x4096 weight at most 2x
the plain MXFP4 fake quantization of the same weight, and a rotated W4A4 forward at most 1.2x
the unrotated W4A4 forward. The weight of a rotated Linear is rotated and quantized once per
weight version (cached), so the rotated forward pays only the online rotation of its
activations: the forward rows time a 4096x4096 MXFP4 W4A4 linear on `--tokens` tokens with its
quantized weight precomputed, the input quantized (after a 32-wide random Hadamard rotation in
the rotated row), and the same through the passes: a Qwen2-shaped model (4 layers, hidden 512)
transformed to MXFP4 W4A4 with and without a `rotate` rule, one forward on 4x128 tokens. Every case runs once per round, rounds repeated `--runs` times; the table
shows medians and their ratio to the row's baseline. Every large allocation gets fresh pages
(glibc's mmap threshold pinned low by re-executing with MALLOC_MMAP_THRESHOLD_ set), so all rows
pay the same page faults, as in bench_formats.py.

    .venv/bin/python benches/bench_rotate.py                 # 2 threads, 4096, 512 tokens
    .venv/bin/python benches/bench_rotate.py --block 4096    # a whole-axis rotation
    .venv/bin/python benches/bench_rotate.py --heal          # the outlier-healing effect

`--heal` measures what the rotation is for instead of its cost: the end-to-end error of MXFP4
W4A4 on every quantized Linear (`qtransform.scan.measure_policy`: next-token KL per token for a
causal LM, output noise/signal for an encoder) without and with a `rotate` rule on the same
sites, on all-MiniLM-L6-v2 (the demo model, its builtin sentences) and on a tiny Qwen2 whose
input norms scale four channels by 30 in every layer (planted activation outliers).
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

GOALS = {"weight": 2.0, "forward": 1.2, "model": 1.2}


def cases(args: argparse.Namespace) -> dict[str, tuple[str, Callable[[], object]]]:
    """name -> (group, function); the first case of each group is its baseline."""
    g = torch.Generator().manual_seed(0)
    n, b = args.size, args.block
    w = torch.randn(n, n, generator=g) * 0.02
    x = torch.randn(args.tokens, n, generator=g)
    signs = H.random_signs(b, 0)
    wq = fake_quantize(w, "mxfp4")
    wq_rot = H.rotate_fake_quantize(w, b, signs, "mxfp4")  # once per weight version
    plain_model, rotated_model, ids = transformed_models(args)
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
        "model W4A4 forward (transform)": ("model", lambda: plain_model(input_ids=ids, use_cache=False)),
        f"model W4A4 forward (transform, rotate pass random_hadamard-{b})": (
            "model", lambda: rotated_model(input_ids=ids, use_cache=False)),
    }


def transformed_models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A Qwen2-shaped model (config-built, `--layers` layers of hidden `--hidden`) transformed to
    MXFP4 W4A4 on every linear but lm_head, without and with a `rotate` rule on the same sites
    (the rotate pass: weights rotated once per version, inputs rotated online)."""
    from qtransform import transform
    from qtransform.models import build_tiny
    from qtransform.scan.setup import scan_policy
    from qtransform.schemas import dump_policy

    model = build_tiny("qwen2", num_layers=args.layers, hidden=args.hidden)
    policy = dump_policy(scan_policy(model, "mxfp4", activations=True))
    where = {k: v for k, v in policy["quantize"][0].items() if k in ("targets", "ignore")}
    rotated = {**policy, "rotate": [{**where, "kind": "random_hadamard", "block_size": args.block}]}
    ids = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(0))
    return transform(model, policy).eval(), transform(model, rotated).eval(), ids


def healing(rotations: list[str]) -> None:
    """The end-to-end error of W4A4 MXFP4 without and with each rotation (see the docstring)."""
    from qtransform.calibration import CalibrationSpec, read_source
    from qtransform.models import build_tiny, demo_model_dir, load_model, load_tokenizer
    from qtransform.scan.remedy import Rotation
    from qtransform.scan.sensitivity import measure_policy
    from qtransform.scan.setup import scan_policy
    from qtransform.schemas import dump_policy

    planted = build_tiny("qwen2", num_layers=4, hidden=128)
    with torch.no_grad():
        for layer in planted.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40, 51]] *= 30
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    folder = demo_model_dir()
    cases = {
        "all-MiniLM-L6-v2 (builtin sentences)": (
            load_model(folder), CalibrationSpec(read_source("builtin"), load_tokenizer(folder))),
        "tiny Qwen2 (hidden 128), 4 planted outlier channels (8x32 tokens)": (planted, CalibrationSpec(ids)),
    }
    print("| model | measure | W4A4 mxfp4 | " + " | ".join(f"+ {r}" for r in rotations) + " |")
    print("|---|---|---:|" + "---:|" * len(rotations))
    for name, (model, calib) in cases.items():
        base = dump_policy(scan_policy(model, "mxfp4", activations=True))
        where = {k: base["quantize"][0][k] for k in ("targets", "ignore", "layers") if k in base["quantize"][0]}
        plain = measure_policy(model, base, calib)
        cells = []
        for text in rotations:
            rule = {**Rotation.parse(text).rule([]), **where}
            rotated = measure_policy(model, {**base, "rotate": [rule]}, calib)
            cells.append(f"{rotated:.4g} ({rotated / plain:.2f}x)")
        measure = "KL per token" if name.startswith("tiny") else "output nsr"
        print(f"| {name} | {measure} | {plain:.4g} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--layers", type=int, default=4, help="model rows: decoder layers")
    ap.add_argument("--hidden", type=int, default=512, help="model rows: hidden size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heal", nargs="*", metavar="ROT",
                    help="measure the outlier-healing effect instead (default rotations: "
                         "hadamard-32 random_hadamard-32 hadamard-64)")
    args = ap.parse_args()
    if args.heal is not None:
        torch.set_num_threads(args.threads)
        healing(args.heal or ["hadamard-32", "random_hadamard-32", "hadamard-64"])
        return 0
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # fresh pages for every large allocation
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    torch.set_num_threads(args.threads)
    if fastpath.unavailable_reason():
        print(f"note: the compiled kernel is not used: {fastpath.unavailable_reason()}")
    table = cases(args)
    times: dict[str, list[float]] = {k: [] for k in table}
    with torch.no_grad():  # not inference_mode: a rotated weight cached there is an inference
        # tensor, which has no version counter for the fake-quant cache to watch
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
        if ms != base and ("fused" in key or "rotated" in key or "rotate pass" in key):
            ok = ratio <= GOALS[group]
            goal = f"<= {GOALS[group]:g}x {'ok' if ok else 'MISSED'}"
            if not ok:
                missed.append(key)
        print(f"| {key} | {ms:.1f} | {ratio:.2f} | {goal} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
