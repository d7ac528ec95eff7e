"""`qtransform export`: a model with a policy applied, as an instrumented ONNX file (`--to onnx`,
the default) or a deployable checkpoint folder (`--to compressed-tensors` / `modelopt`)."""

from __future__ import annotations

import argparse
import json
import time

import torch

from qtransform.cli.options import add_calib, calib_batches
from qtransform.core import io as qio
from qtransform.errors import UserError
from qtransform.export.checkpoint import FORMATS, export_checkpoint
from qtransform.export.onnx import check_opset, export_onnx
from qtransform.models import engine_differences, input_paths, load_model, load_tokenizer
from qtransform.pipeline import transform
from qtransform.report.page import page_beside
from qtransform.report.run_pages import export_page, export_summary
from qtransform.report.scan_pages import command_line
from qtransform.schemas import load_policy

EPILOG = """\
examples:
  qtransform export builtin:qwen2 --policy schemas/examples/w4a16_mxfp4.json --out qwen2.onnx
  qtransform export ./Qwen2.5-0.5B --policy policy.json --out q.onnx --seq-len 128 --noise off
  qtransform export ./model --policy p.json --out q_qdq.onnx --fake-quant qdq --no-taps
  qtransform export ./model --policy p.json --out q.onnx --attention-mask   # padded batches
  qtransform export ./Qwen2.5-0.5B --policy '{"preset": "llm-compressor/NVFP4"}' --calib calib.jsonl \
      --to compressed-tensors --out qwen-nvfp4        # a folder vLLM and transformers load

The file runs in plain onnxruntime (fake-quant nodes carry their ONNX function bodies), taps are
graph outputs `tap:<site>:<point>`, noise draws graph inputs `noise:<site>/<point>` (zeros turn
the noise off). --fake-quant qdq writes QuantizeLinear/DequantizeLinear for deployment
toolchains (opset 24; onnxruntime 1.31 cannot run it). See docs/onnx.md.

--to compressed-tensors writes llm-compressor's checkpoint layout, --to modelopt ModelOpt's
(NVFP4, FP8): the quantized weights, config.json with the scheme, the tokenizer; what the format
cannot express is refused before anything is written. See docs/export.md."""


MAX_BATCH = 4096  # an example batch only shapes the trace; larger ones just cost memory
MAX_SEQ_LEN = 65536


def _positive(text: str) -> int:
    if len(text) > 12:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:20]!r}...")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a transformed model to ONNX or a deployable checkpoint",
                       description="Apply POLICY to MODEL and export it to ONNX (default) or as a "
                                   "quantized checkpoint folder (--to).",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="local HF model folder, or builtin:<arch>")
    p.add_argument("--policy", required=True, metavar="P", help="policy JSON file")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="output .onnx file, or the checkpoint folder with --to (written atomically)")
    p.add_argument("--to", choices=("onnx", *FORMATS), default="onnx",
                   help="onnx (default), or a checkpoint folder in compressed-tensors' or ModelOpt's layout")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="checkpoints: shard the weights past this size (default 5GB)")
    p.add_argument("--force", action="store_true",
                   help="checkpoints: replace an existing --out folder that qtransform did not write")
    p.add_argument("--seq-len", type=_positive, default=16, metavar="N", help="example sequence length (default 16)")
    p.add_argument("--batch", type=_positive, default=1, metavar="B", help="example batch size (default 1)")
    p.add_argument("--fake-quant", choices=("function", "inline", "qdq"), default="function",
                   help="function bodies (default), inlined bodies, or QuantizeLinear/DequantizeLinear")
    p.add_argument("--no-taps", action="store_true", help="drop the tap outputs")
    p.add_argument("--noise", choices=("input", "random", "off"), default="input",
                   help="noise draws as graph inputs (default), seeded RandomNormalLike, or none")
    p.add_argument("--static", action="store_true", help="fixed input shapes instead of dynamic batch/sequence")
    p.add_argument("--attention-mask", action="store_true",
                   help="an attention_mask input beside input_ids, so padded batches run")
    p.add_argument("--optimize", action="store_true",
                   help="run onnxscript's graph optimizer (fewer nodes; about half of the export time)")
    p.add_argument("--opset", type=_positive, default=None, help="ONNX opset (default 21; 24 for qdq)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    add_calib(p)
    p.set_defaults(func=run_export)


def example_input_ids(model, batch: int, seq_len: int):
    """Token ids drawn from the model config's vocabulary (fixed seed)."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise UserError("the model has no config.vocab_size to build example input ids from")
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{type(model).__name__} is an encoder-decoder model; export takes "
                        "decoder-only or encoder-only models (scan and transform work on it)")
    limit = getattr(config, "max_position_embeddings", None) or MAX_SEQ_LEN
    if seq_len > limit:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({limit})")
    if batch > MAX_BATCH:
        raise UserError(f"--batch {batch}: an example batch of at most {MAX_BATCH} (the exported "
                        "batch axis is dynamic anyway)")
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))


# ONNX-only options and their defaults: given with a checkpoint --to, they would do nothing
ONNX_ONLY = {"seq_len": 16, "batch": 1, "fake_quant": "function", "no_taps": False, "noise": "input",
             "static": False, "attention_mask": False, "optimize": False, "opset": None}


def run_export(args: argparse.Namespace) -> int:
    if args.to != "onnx":
        return run_checkpoint(args)
    if args.max_shard_size != "5GB" or args.force:
        raise UserError("--max-shard-size and --force apply to checkpoints (--to compressed-tensors "
                        "or modelopt), not to ONNX files")
    check_opset(args.fake_quant, args.opset)
    qio.check_file_target(page_beside(args.out))  # the page beside the model, before any work
    with qio.output_file(args.out):
        policy = load_policy(args.policy)
        model = load_model(args.model)
        ids = example_input_ids(model, args.batch, args.seq_len)  # checks the options first
        model = transform(model, policy, inplace=True,
                          calibration=calib_batches(args.calib, args.model, model))
        start = time.perf_counter()
        path = export_onnx(model, args.out, {"input_ids": ids}, dynamic=not args.static,
                           fake_quant=args.fake_quant, taps=not args.no_taps, noise=args.noise,
                           opset=args.opset, attention_mask=args.attention_mask,
                           optimize=args.optimize)
    seconds = time.perf_counter() - start
    summary, log = export_summary(path, model, args.fake_quant)
    summary = {"out": summary["out"], "seconds": round(seconds, 2), **summary}
    export_page(summary, log, command=command_line()).write(page_beside(path))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        taps = sum(1 for o in summary["outputs"] if o.startswith("tap:"))
        noise = sum(1 for i in summary["inputs"] if i.startswith("noise:"))
        print(f"exported {path} in {seconds:.1f} s: {summary['fake_quant_nodes']} fake-quant nodes "
              f"({args.fake_quant}), {taps} taps, {noise} noise inputs")
    return 0


def run_checkpoint(args: argparse.Namespace) -> int:
    """`--to compressed-tensors | modelopt`: the transformed model as a checkpoint folder."""
    extra = [f"--{k.replace('_', '-')}" for k, v in ONNX_ONLY.items() if getattr(args, k) != v]
    if extra:
        raise UserError(f"{', '.join(extra)} apply to ONNX exports; drop them with --to {args.to}")
    qio.check_folder_target(args.out, "export", force=args.force, protect=input_paths(args.model, args.policy))
    policy = load_policy(args.policy)
    model = load_model(args.model)
    start = time.perf_counter()
    model = transform(model, policy, inplace=True, calibration=calib_batches(args.calib, args.model, model))
    out = export_checkpoint(model, args.out, format=args.to, tokenizer=load_tokenizer(args.model),
                            max_shard_size=args.max_shard_size, force=args.force)
    seconds = time.perf_counter() - start
    files = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    engine = engine_differences(out, dtype=dtype)
    summary = {"out": str(out), "format": args.to, "seconds": round(seconds, 2), "files": files,
               "engine_differences": {"vllm": engine}}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"exported {out} ({args.to}) in {seconds:.1f} s: {', '.join(files)}")
        print("what vLLM computes differently from the fake-quantized model, per backend "
              "(checkpoint_policy(model, engine=\"vllm\", backend=...) simulates what says simulated):")
        for backend, lines in engine.items():
            print("\n".join(f"  {backend}: {line}" for line in lines))
    return 0
