"""Time qtransform's fake quantization against torchao and compressed-tensors, side by side.

The same tensor, the same formats, in one run: every case (the floor `x * 2.0`, qtransform,
each peer) runs once per round, rounds interleaved, medians reported, and every large
allocation gets fresh pages (re-executed with MALLOC_MMAP_THRESHOLD_ set, as bench_formats.py
does). Each peer row gives its time over qtransform's, and the share of elements bit-identical
to qtransform with the options that make the two agree (named in the row). The peers are an
optional extra (`pip install -c constraints.txt qtransform[peers]`); a missing one is skipped
with a message.

    .venv/bin/python benches/bench_peers.py                 # 4096x4096, fp32 and bf16, 2 threads
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from qtransform.formats import fake_quantize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torchao_cases(x: torch.Tensor) -> dict[str, tuple[str, dict, Callable[[], torch.Tensor]]]:
    """format -> (peer label, our agreeing options, peer fake quantization)."""
    try:
        from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except ImportError as err:
        print(f"torchao: not installed or not importable ({err}); skipped")
        return {}

    def mx(elem: torch.dtype | str) -> Callable[[], torch.Tensor]:
        return lambda: MXTensor.to_mx(x, elem, 32).dequantize(x.dtype)

    def nvfp4() -> torch.Tensor:
        scale = x.abs().amax().float() / (F8E4M3_MAX * F4_E2M1_MAX)
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)

    return {
        "mxfp4": ("torchao MXTensor (floor)", {}, mx(torch.float4_e2m1fn_x2)),
        "mxfp8_e4m3": ("torchao MXTensor (floor)", {}, mx(torch.float8_e4m3fn)),
        "nvfp4": ("torchao NVFP4Tensor, two-level", {}, nvfp4),
    }


def ct_cases(x: torch.Tensor) -> dict[str, tuple[str, dict, Callable[[], torch.Tensor]]]:
    try:
        from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fq
        from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16, W4A16
        from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    except ImportError as err:
        print(f"compressed-tensors: not installed or not importable ({err}); skipped")
        return {}

    def grouped(args, two_level: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:  # what llm-compressor does for a weight: observe, then QDQ
            g = x.reshape(x.shape[0], -1, args.group_size)
            lo, hi = g.amin(-1), g.amax(-1)
            gs = generate_gparam(x.amin(), x.amax()) if two_level else None
            scale, zp = calculate_qparams(lo, hi, args, global_scale=gs)
            return ct_fq(x, scale, zp, args, global_scale=gs)
        return run

    return {
        "mxfp4": ("compressed-tensors MXFP4A16", {"scale_rule": "even"},
                  grouped(MXFP4A16["weights"], False)),
        "nvfp4": ("compressed-tensors NVFP4A16", {"nvfp4_variant": "compressed-tensors"},
                  grouped(NVFP4A16["weights"], True)),
        "int4": ("compressed-tensors W4A16 (scale amax/7.5)", {}, grouped(W4A16["weights"], False)),
    }


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def identical_share(a: torch.Tensor, b: torch.Tensor) -> float:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    a, b = a.to(b.dtype).contiguous(), b.contiguous()
    return (a.view(bits) == b.view(bits)).double().mean().item()


def run_dtype(x: torch.Tensor, dtype: str, runs: int) -> None:
    peers = {"torchao": torchao_cases(x), "compressed-tensors": ct_cases(x)}
    cases: dict[str, Callable[[], object]] = {"floor": lambda: x * 2.0}
    rows = []  # (format, peer label, our options, our key, peer key)
    for peer, table in peers.items():
        for fmt, (label, opts, fn) in table.items():
            ours = f"qtransform {fmt} {opts}"
            cases.setdefault(ours, lambda fmt=fmt, opts=opts: fake_quantize(x, fmt, **opts))
            cases[f"{peer} {fmt}"] = fn
            rows.append((fmt, label, opts, ours, f"{peer} {fmt}"))
    if not rows:
        print(f"{dtype}: no peer installed; nothing to compare")
        return
    outputs = {k: fn() for k, fn in cases.items()}  # warm up, and keep one output per case
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(runs):
        for key, fn in cases.items():
            times[key].append(_time(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{dtype}: floor x * 2.0 {med['floor'] * 1e3:.1f} ms; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())} after the runs")
    print(f"| format ({dtype}) | peer | qtransform ms | peer ms | peer / qtransform | "
          f"bit-identical | qtransform options |\n|---|---|---:|---:|---:|---:|---|")
    for fmt, label, opts, ours, theirs in rows:
        share = identical_share(outputs[theirs], outputs[ours])
        print(f"| {fmt} | {label} | {med[ours] * 1e3:.1f} | {med[theirs] * 1e3:.1f} | "
              f"{med[theirs] / med[ours]:.1f}x | {share * 100:.2f} % | "
              f"{', '.join(f'{k}={v}' for k, v in opts.items()) or 'defaults'} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # fresh pages for every large allocation
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {args.threads} threads, x: {tuple(x.shape)} N(0,1), "
          f"median of {args.runs} interleaved rounds")
    for name in args.dtypes.split(","):
        run_dtype(x.to(DTYPES[name]), name, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
