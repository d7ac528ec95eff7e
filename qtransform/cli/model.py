"""`qtransform plan` and `qtransform transform`: what a policy selects, and applying it."""

from __future__ import annotations

import argparse
import json

from qtransform.checkpoints import describe
from qtransform.cli.options import add_calib, calib_batches
from qtransform.core import io as qio
from qtransform.core.program import insertion_log
from qtransform.errors import UserError
from qtransform.models import BUILTIN, checkpoint_policy, input_paths, load_model, loaded_checkpoint
from qtransform.pipeline import plan, transform, transform_program
from qtransform.pipeline.saving import write_transformed
from qtransform.scan.grid import grid_line
from qtransform.scan.weights import weight_grids
from qtransform.schemas import load_policy

EPILOG_PLAN = """example:
  qtransform plan ./Qwen2.5-0.5B schemas/examples/w4a16_mxfp4.json
  qtransform plan builtin:qwen2 policy.json --json > plan.json
"""
EPILOG_TRANSFORM = """example:
  qtransform transform ./Qwen2.5-0.5B schemas/examples/w4a16_mxfp4.json --out ./qwen-w4a16
  # reload in Python: qtransform.load_transformed("./qwen-w4a16")
"""


def register(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("plan", help="list every site and the rule that selects it",
                       epilog=EPILOG_PLAN, formatter_class=fmt)
    p.add_argument("model", help=f"local HF model folder, or builtin:<{'|'.join(BUILTIN)}>")
    p.add_argument("policy", nargs="?", help="policy JSON file; omitted for a quantized checkpoint "
                   "(compressed-tensors, ModelOpt): the policy that describes it")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_calib(p)
    p.set_defaults(func=run_plan)

    t = sub.add_parser("transform", help="apply a policy and save the transformed model",
                       epilog=EPILOG_TRANSFORM, formatter_class=fmt)
    t.add_argument("model", help="local HF model folder, or builtin:<arch>")
    t.add_argument("policy", nargs="?", help="policy JSON file; omitted for a quantized checkpoint: "
                   "the policy that reproduces its deployed model")
    t.add_argument("--out", required=True, help="output folder (save_pretrained + policy); a new "
                   "or empty folder, or a previous `qtransform transform` output")
    t.add_argument("--force", action="store_true",
                   help="replace --out even when it is a folder qtransform did not write")
    t.add_argument("--json", action="store_true", help="print a JSON summary")
    add_calib(t)
    t.set_defaults(func=run_transform)


def model_and_policy(args: argparse.Namespace):
    """The model and the policy file, or without one the policy of the quantized checkpoint
    the model was opened from (a plain model without a policy is an error saying what to give)."""
    model = load_model(args.model)
    if args.policy is not None:
        return model, load_policy(args.policy)
    found = checkpoint_policy(model)
    if found is None:
        raise UserError(f"{args.model}: no policy given, and the model is not a quantized "
                        "checkpoint (compressed-tensors or ModelOpt) whose policy could be read; "
                        "give a policy JSON file")
    return model, load_policy(found)


def run_plan(args: argparse.Namespace) -> int:
    model, policy = model_and_policy(args)
    checkpoint = loaded_checkpoint(model)
    if checkpoint is not None and not args.json:
        print("\n".join(describe(checkpoint)))
    if args.calib is None:
        result = plan(model, policy)
    else:  # the plan of the calibrated model: static scales with their values
        batches = calib_batches(args.calib, args.model, model)
        result = transform_program(model, policy, inplace=True, calibration=batches).plan()
    grids = weight_grids(model)
    if args.json:
        print(json.dumps({**result.to_dict(), "grids": grids}, indent=2))
    else:
        print(result.to_text())
        if line := grid_line(grids):
            print(line)
    return 0


def run_transform(args: argparse.Namespace) -> int:
    with qio.output_folder(args.out, "transform", force=args.force,
                           protect=input_paths(args.model, args.policy)) as staging:
        model, policy = model_and_policy(args)
        model = transform(model, policy, inplace=True,
                          calibration=calib_batches(args.calib, args.model, model))
        write_transformed(model, policy, staging)
    log = [i.to_dict() for i in insertion_log(model)]
    n = len(log)
    if args.json:
        print(json.dumps({"out": str(args.out), "insertions": log}, indent=2))
    else:
        print(f"transformed: {n} insertions; saved to {args.out} (reload: qtransform.load_transformed)")
    return 0
