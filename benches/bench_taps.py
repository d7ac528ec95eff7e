"""Cost of instrument taps: one forward of a transformed model with enabled taps (default
instrument section: weight, input and output taps, shadow products, every metric) against the same
transformed model without an instrument section, at several token strides.

    OMP_NUM_THREADS=1 .venv/bin/python benches/bench_taps.py [--model demo] [--device cuda]

Every variant is timed in the same run, interleaved round by round; the median of `--repeats`
rounds is reported as a ratio to the model without taps (target: <= 1.5x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import qtransform
from qtransform.models import build_tiny, load_model
from qtransform.passes.instrument import tapping

STRIDES = (1, 4, 16, 64)  # 16: the default of scan_activations


POLICIES = {"W4A16 mxfp4": ["weight"], "W4A4 mxfp4": ["weight", "input"]}  # quantized tensors


def forward(model: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin", help="'builtin' (narrow Qwen2) or 'demo'")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.model == "demo":
        base = load_model("demo").to(device)
        vocab, ignore, name = base.config.vocab_size, [], "all-MiniLM-L6-v2 (BERT, 6 layers, 384)"
    else:
        base = build_tiny("qwen2", num_layers=args.layers, hidden=args.hidden).to(device)
        vocab, ignore = base.config.vocab_size, ["lm_head"]
        name = f"Qwen2-shaped, {args.layers} layers, hidden {args.hidden}"
    x = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    x = x.to(device)
    print(f"{name}; batch {args.batch} x {args.seq} tokens; {device}; "
          f"{torch.get_num_threads()} threads; median of {args.repeats}\n")
    print("| policy | forward without taps | " + " | ".join(f"taps, stride {k}" for k in STRIDES) + " |")
    print("|---|---|" + "---|" * len(STRIDES))
    for label, tensors in POLICIES.items():
        rule = {"targets": ["Linear"], "ignore": ignore, "format": "mxfp4", "tensors": tensors}
        plain = qtransform.transform(base, {"version": 1, "quantize": [rule]})
        tapped = qtransform.transform(base, {"version": 1, "quantize": [rule],
                                             "instrument": {"targets": ["Linear"], "ignore": ignore}})
        times: dict[object, list[float]] = {"plain": [], **{k: [] for k in STRIDES}}
        forward(plain, x, device)
        forward(tapped, x, device)  # first call: weights quantized and measured once
        for _ in range(args.repeats):
            times["plain"].append(forward(plain, x, device))
            for k in STRIDES:
                with tapping(tapped, stride=k):
                    times[k].append(forward(tapped, x, device))
        base_s = statistics.median(times["plain"])
        cells = [f"{statistics.median(times[k]) / base_s:.2f}x" for k in STRIDES]
        print(f"| {label} | {1e3 * base_s:.1f} ms | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
