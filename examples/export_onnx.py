"""Export a W4A16 MXFP4 model with taps to ONNX and read the taps back from onnxruntime.

Fake-quant nodes are `qtransform.MXFP4FakeQuant` nodes with their ONNX function bodies, so plain
onnxruntime runs the file; each instrumented (site, point) is a graph output `tap:<site>:<point>`.

    python examples/export_onnx.py ./Qwen2.5-0.5B-Instruct --out qwen-w4a16.onnx
    python examples/export_onnx.py --tiny --out /tmp/tiny.onnx    # a config-built 2-layer Qwen2
"""

from __future__ import annotations

import argparse

import onnxruntime as ort
import torch

import qtransform
from qtransform.models import build_tiny, load_model

POLICY = {
    "version": 1,
    "quantize": [{"name": "w4a16", "targets": ["Linear"], "ignore": ["lm_head"],
                  "format": "mxfp4", "tensors": ["weight"]}],
    "instrument": {"targets": ["re:.*mlp\\..*"], "points": ["input", "output"]},
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="local HF causal-LM folder")
    parser.add_argument("--tiny", action="store_true", help="use a tiny config-built Qwen2")
    parser.add_argument("--out", default="model-w4a16.onnx", help="ONNX file to write")
    args = parser.parse_args(argv)
    if not (args.tiny or args.model):
        parser.error("give a model folder or --tiny")
    model = build_tiny("qwen2") if args.tiny else load_model(args.model)

    quantized = qtransform.transform(model, POLICY).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    path = qtransform.export_onnx(quantized, args.out, {"input_ids": ids})

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    results = dict(zip(names, session.run(None, {"input_ids": ids.numpy()}), strict=True))
    with torch.no_grad():
        reference = quantized(input_ids=ids).logits
    diff = (torch.from_numpy(results["logits"]) - reference).abs().max().item()
    taps = [n for n in names if n.startswith("tap:")]
    print(f"wrote {path}: {len(taps)} taps, max |onnxruntime - torch| = {diff:.2e}")
    for name in taps[:4]:
        print(f"  {name}: shape {list(results[name].shape)}")
    return {"path": path, "taps": taps, "max_abs_diff": diff}


if __name__ == "__main__":
    main()
