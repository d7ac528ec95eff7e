"""ONNX export cost and onnxruntime speed for 2- and 8-layer Qwen2-shaped models.

For each model (config-built, hidden 256, vocab 256) and policy (W4A16 MXFP4; W4A4 MXFP4 on
weights and linear inputs): export time of one dynamic export, onnxruntime session setup, and
one forward in onnxruntime against the PyTorch transformed model on the same input (runs
interleaved round by round, medians), plus the largest logit difference.

    OMP_NUM_THREADS=1 .venv/bin/python benches/bench_onnx.py [--layers 2 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import qtransform
from qtransform.models import build_tiny

POLICIES = {
    "W4A16 mxfp4": ["weight"],
    "W4A4 mxfp4": ["weight", "input"],
}


def policy(tensors: list[str]) -> dict:
    return {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4",
                                        "tensors": tensors}]}


def bench(layers: int, name: str, tensors: list[str], repeats: int, folder: Path, tokens: tuple[int, int]) -> dict:
    model = qtransform.transform(build_tiny("qwen2", num_layers=layers, hidden=256), policy(tensors))
    ids = torch.randint(0, 256, tokens, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    path = qtransform.export_onnx(model, folder / f"q{layers}.onnx", {"input_ids": ids[:, :8]})
    export_s = time.perf_counter() - start
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    start = time.perf_counter()
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session_s = time.perf_counter() - start
    feeds = {"input_ids": ids.numpy()}
    onnx_times, torch_times = [], []
    with torch.no_grad():
        want = model(input_ids=ids).logits.numpy()
        got = session.run(None, feeds)[0]
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(None, feeds)
            onnx_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            model(input_ids=ids)
            torch_times.append(time.perf_counter() - start)
    t_onnx, t_torch = statistics.median(onnx_times), statistics.median(torch_times)
    return {
        "layers": layers, "policy": name, "export_s": export_s, "session_s": session_s,
        "onnx_ms": 1e3 * t_onnx, "torch_ms": 1e3 * t_torch, "ratio": t_onnx / t_torch,
        "max_diff": float(np.abs(got - want).max()), "logit_scale": float(np.abs(want).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}, input {args.batch}x{args.seq} tokens\n")
    print("| layers | policy | export s | session s | onnxruntime ms | PyTorch ms | ratio | max logit diff |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for name, tensors in POLICIES.items():
                r = bench(layers, name, tensors, args.repeats, Path(tmp), (args.batch, args.seq))
                print(f"| {r['layers']} | {r['policy']} | {r['export_s']:.1f} | {r['session_s']:.2f} | "
                      f"{r['onnx_ms']:.1f} | {r['torch_ms']:.1f} | {r['ratio']:.2f} | "
                      f"{r['max_diff']:.1e} (of {r['logit_scale']:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
