"""Peak memory and time of the sequential (layer-by-layer) activation scan against the in-memory
scan, on a Qwen2-shaped checkpoint of at least 1 GiB written to a temporary folder.

    .venv/bin/python benches/bench_sequential_scan.py [--layers 24] [--hidden 896]
        [--intermediate 4864] [--vocab 151936] [--samples 8] [--tokens 64] [--format mxfp4]

The defaults are Qwen2-0.5B's shapes in fp32 (494 M parameters, 1.98 GB). Each scan runs in its
own process (`--run memory|sequential`), which reports its peak RSS (`ru_maxrss`), the RSS after
imports (the baseline both share) and the scan's wall time; the parent checks that both reports
have the same rows and end-to-end metrics, prints one table, and deletes the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def build(folder: Path, args: argparse.Namespace) -> int:
    """Write the checkpoint; returns its size in bytes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def run(mode: str, folder: str, args: argparse.Namespace, out: str) -> None:
    """One scan in this process; writes its figures and report to `out`."""
    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401 (imported before the baseline RSS)

    import qtransform  # noqa: F401
    from qtransform.models import load_model
    from qtransform.scan.activations import scan_activations
    from qtransform.scan.sequential import scan_sequential

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    calib = torch.randint(0, args.vocab, (args.samples, args.tokens),
                          generator=torch.Generator().manual_seed(0))
    base = rss_mib()
    start = time.perf_counter()
    if mode == "memory":
        report = scan_activations(load_model(folder), args.format, calib, batch_size=4)
    else:
        report = scan_sequential(folder, args.format, calib, batch_size=4)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    data = json.loads(report.to_json())
    Path(out).write_text(json.dumps({"seconds": seconds, "peak_mib": peak, "base_mib": base,
                                     "rows": data["rows"],
                                     "end_to_end": data["meta"]["end_to_end"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--format", default="mxfp4")
    parser.add_argument("--run", choices=["memory", "sequential"], help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run, args.ckpt, args, args.result)
        return
    work = Path(tempfile.mkdtemp(prefix="qtransform-seqbench-", dir="/tmp"))
    try:
        folder = work / "ckpt"
        size = build(folder, args)
        print(f"checkpoint: {size / 2**30:.2f} GiB, {args.layers} layers, hidden {args.hidden}, "
              f"{args.samples} x {args.tokens} tokens, {args.format}")
        results = {}
        for mode in ("sequential", "memory"):
            out = work / f"{mode}.json"
            forwarded = sys.argv[1:]
            subprocess.run([sys.executable, __file__, *forwarded, "--run", mode, "--ckpt",
                            str(folder), "--result", str(out)], check=True)
            results[mode] = json.loads(out.read_text())
        seq, mem = results["sequential"], results["memory"]
        same = seq["rows"] == mem["rows"] and seq["end_to_end"] == mem["end_to_end"]
        print("| scan | peak RSS (MiB) | above imports (MiB) | time (s) |")
        print("|---|---|---|---|")
        for mode in ("memory", "sequential"):
            r = results[mode]
            print(f"| {mode} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['base_mib']:.0f} | "
                  f"{r['seconds']:.1f} |")
        print(f"sequential / in-memory: peak above imports "
              f"{(seq['peak_mib'] - seq['base_mib']) / (mem['peak_mib'] - mem['base_mib']):.2f}x, "
              f"time {seq['seconds'] / mem['seconds']:.2f}x; reports identical: {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
