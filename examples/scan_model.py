"""SRDD scans of a model: which layers lose most under MXFP4, and is NVFP4 better?

1. a weight scan (no data): every Linear weight fake-quantized once and compared with itself;
2. MXFP4 against NVFP4 on the same weights, totals over the whole model;
3. an activation scan of the W4A16 model on calibration text: each site's own error, the error
   accumulated from the input on, and the end-to-end effect (loss and perplexity for causal LMs).

Reports (JSON, CSV, Markdown, PNG) go to --out.

    python examples/scan_model.py ./Qwen2.5-0.5B-Instruct --out scans/qwen
    python examples/scan_model.py --tiny --out /tmp/scans      # a config-built 2-layer Qwen2
"""

from __future__ import annotations

import argparse

import torch

import qtransform
from qtransform.calibration import builtin_calibration
from qtransform.models import build_tiny, load_model, load_tokenizer
from qtransform.scan import compare_formats, scan_weights


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="local HF model folder or safetensors checkpoint")
    parser.add_argument("--tiny", action="store_true", help="use a tiny config-built Qwen2")
    parser.add_argument("--out", default="scans", help="folder for the reports (default ./scans)")
    args = parser.parse_args(argv)
    if not (args.tiny or args.model):
        parser.error("give a model folder or --tiny")
    model = build_tiny("qwen2") if args.tiny else load_model(args.model)

    weights = scan_weights(model, "mxfp4")
    weights.save(f"{args.out}/weights")
    for entry in weights.layer_summary():
        print(f"layer {entry['layer']:2d}: SQNR {entry['sqnr_db']:6.2f} dB, "
              f"worst {entry['worst_site']} ({entry['worst_sqnr_db']:.2f} dB)")

    comparison = compare_formats(model, ["mxfp4", "nvfp4"])
    print(comparison.to_markdown())

    if args.tiny:  # random token ids: the tiny model has no tokenizer
        calib, tokenizer = torch.randint(0, model.config.vocab_size, (8, 32)), None
    else:
        calib, tokenizer = builtin_calibration(), load_tokenizer(args.model)
    activations = qtransform.scan_activations(model, "mxfp4", calib, tokenizer=tokenizer)
    activations.save(f"{args.out}/activations")
    end = activations.meta["end_to_end"]
    print(f"end to end: output SQNR {end['sqnr_db']:.2f} dB"
          + (f", perplexity {end['perplexity_fp']:.2f} -> {end['perplexity_quant']:.2f}"
             if "perplexity_fp" in end else ""))
    print(f"{len(weights.problems())} problematic weights; reports in {args.out}/")
    return {"weights": weights, "comparison": comparison, "activations": activations}


if __name__ == "__main__":
    main()
