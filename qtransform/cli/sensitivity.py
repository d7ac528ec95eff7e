"""`qtransform sensitivity`: rank sites by what quantizing each alone does to the model's output,
and (with a budget) the mixed-precision policy that keeps the most sensitive ones."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtransform.calibration import CalibrationSpec, read_source
from qtransform.cli.options import add_common, format_options, progress
from qtransform.core import io as qio
from qtransform.errors import UserError
from qtransform.models import input_paths, load_model, load_tokenizer
from qtransform.report.scan_pages import command_line, sensitivity_page
from qtransform.scan.budget import measured_budget
from qtransform.scan.sensitivity import site_sensitivity
from qtransform.scan.sensitivity_report import measure_label, timing_text
from qtransform.scan.setup import scan_policy

if TYPE_CHECKING:
    from qtransform.scan.budget import Budgeted

EPILOG = """examples:
  qtransform sensitivity ./Qwen2.5-0.5B --format mxfp4 --calib calib.txt --out sens/mxfp4
  qtransform sensitivity builtin:qwen2 --format nvfp4 --calib ids.json --out sens/w4a4 --activations
  qtransform sensitivity ./Qwen2.5-0.5B --format mxfp4 --calib calib.txt --out sens/b --bits 5
  qtransform sensitivity demo --format mxfp4 --calib builtin --out sens/demo --method both
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sensitivity", help="per-site end-to-end sensitivity (KL, output error) and "
                                           "budgeted mixed precision",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF/safetensors folder, builtin:<arch> or demo")
    p.add_argument("--format", help="format (W4A16 on every linear site but lm_head)")
    p.add_argument("--policy", help="policy JSON whose quantize rules select the sites instead")
    p.add_argument("--calib", required=True, metavar="FILE",
                   help="calibration data: text file, .json strings or id lists, or 'builtin'")
    p.add_argument("--out", required=True, help="folder for sensitivity.json/.csv/.md/.png")
    p.add_argument("--force", action="store_true", help="replace --out even when qtransform did not write it")
    p.add_argument("--method", choices=("exact", "estimate", "both"), default="exact",
                   help="exact: one run per site; estimate: one backward pass per batch and draw "
                        "(large models); both: records their agreement")
    p.add_argument("--activations", action="store_true", help="W4A4: quantize each site's input too")
    p.add_argument("--rotation", metavar="ROT",
                   help="also measure each site exactly with this rotation on it (e.g. hadamard-32): "
                        "the KL with and without it, side by side")
    p.add_argument("--draws", type=int, default=4, help="estimate: sampled backward passes per batch")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    add_budget(p)
    add_common(p)
    p.set_defaults(func=run_sensitivity)


def add_budget(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bits", type=float, help="budget: mean effective bits per weight (kept sites: 16)")
    g.add_argument("--keep", help="budget: sites to keep in high precision, a count or a share (10%%)")
    g.add_argument("--kl-target", type=float,
                   help="budget: predicted end-to-end sensitivity (KL per token, or output nsr) at most this")


def budget_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The one budget given on the command line, as `budget_policy` keywords (None: none)."""
    if args.bits is not None:
        if not math.isfinite(args.bits) or args.bits <= 0:
            raise UserError(f"--bits {args.bits}: give a positive number of bits, e.g. --bits 5")
        return {"bits": args.bits}
    if args.kl_target is not None:
        if not math.isfinite(args.kl_target) or args.kl_target < 0:
            raise UserError(f"--kl-target {args.kl_target}: give a non-negative number, e.g. 0.01")
        return {"target": args.kl_target}
    if args.keep is not None:
        text = args.keep.strip()
        try:
            if text.endswith("%"):
                share = float(text[:-1]) / 100
                if not 0 <= share <= 1:
                    raise ValueError
                return {"share": share}
            count = int(text)
            if count < 0:
                raise ValueError
            return {"keep": count}
        except ValueError:
            raise UserError(f"--keep {text!r}: give a site count (3) or a share (10%)") from None
    return None


def budget_text(result: Budgeted, measure: str) -> str:
    label = measure_label(measure)
    kept = ", ".join(result.kept_sites[:8]) + (" ..." if len(result.kept_sites) > 8 else "")
    text = (f"budget {', '.join(f'{k}={v:g}' for k, v in result.budget.items())} ({result.method}): keep "
            f"{len(result.kept_sites)} site(s) in high precision{': ' + kept if kept else ''}; "
            f"{result.effective_bits:.3f} effective bits per weight; predicted {label} "
            f"{result.predicted:.4g}")
    if result.measured is not None:
        text += f", measured {result.measured:.4g}"
    return text


def run_sensitivity(args: argparse.Namespace) -> int:
    if args.format is None and args.policy is None:
        raise UserError("give --format (e.g. --format mxfp4) or a --policy with quantize rules")
    if args.policy is not None and not Path(args.policy).exists():
        raise UserError(f"{args.policy}: no such policy file")
    if args.draws < 1 or args.batch_size < 1 or args.max_length < 1:
        raise UserError("--draws, --batch-size and --max-length must be positive")
    budget = budget_args(args)
    samples = read_source(args.calib)
    with qio.output_folder(args.out, "sensitivity", force=args.force,
                           protect=input_paths(args.model, args.policy, args.calib)) as staging:
        model = load_model(args.model)
        tokenizer = load_tokenizer(args.model)
        policy = scan_policy(model, args.format, args.policy, options=format_options(args),
                             activations=args.activations)
        calib = CalibrationSpec(samples, tokenizer, args.batch_size, args.max_length, source=args.calib)
        report = site_sensitivity(model, policy, calib, method=args.method, draws=args.draws,
                                  progress=progress(args), rotation=args.rotation)
        report.meta["source"] = args.model
        files = list(report.save(staging).values())
        files.append(sensitivity_page(report, command=command_line()).write(staging / "sensitivity.html"))
        result = None
        if budget is not None:
            result = measured_budget(report, budget, model, calib)
            files.append(qio.write_json(staging / "policy.json", result.policy))
            qio.write_json(staging / "budget.json", {k: v for k, v in result.to_dict().items()
                                                       if k != "policy"})
    if args.json:
        print(json.dumps({**report.to_dict(), "budget": result.to_dict() if result else None}, indent=2))
        return 0
    print(report.markdown().rstrip())
    print(f"\n{timing_text(report.meta)}")
    if result is not None:
        print(budget_text(result, report.measure))
    print(f"\nwrote {', '.join(str(Path(args.out) / p.name) for p in files)}")
    return 0
