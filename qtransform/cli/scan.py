"""`qtransform scan`, `compare` and `guide`: SRDD scans from the terminal.

`scan --calib FILE` runs the activation scan (`qtransform.scan.activations.scan_activations`)
instead of the weight scan; `--calib builtin` uses the demo's calibration sentences.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from qtransform.cli.options import (
    add_common,
    add_flagging,
    flagging,
    format_options,
    progress,
    thresholds,
)
from qtransform.errors import UserError

MAX_TIER = 100.0  # an AQN sigma multiplier beyond this drowns the weights in noise
MAX_STEPS = 10**9

EPILOG_SCAN = """examples:
  qtransform scan                     # the demo: all-MiniLM-L6-v2, MXFP4 vs NVFP4, ONNX
  qtransform scan ./Qwen2.5-1.5B --format mxfp4 --out scans/mxfp4
  qtransform scan model.safetensors --format mxfp4 --scale-rule rceil --out scans/rceil --json
  qtransform scan ./Qwen2.5-1.5B --policy policy.json --out scans/p --fail-on-problematic
"""
EPILOG_COMPARE = """example:
  qtransform compare ./Qwen2.5-1.5B --formats mxfp4,nvfp4,mxfp8_e4m3
"""
EPILOG_GUIDE = """examples:
  qtransform guide scans/mxfp4/report.json --out policy.json
  qtransform guide scans/mxfp4 --out aqn.json --aqn --tiers 1.5,1.2,1.0 --total-steps 174
"""


def register(sub: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("scan", help="per-layer quantization error of a model's weights (SRDD scan)",
                       epilog=EPILOG_SCAN, formatter_class=raw)
    s.add_argument("model", nargs="?",
                   help="safetensors file, HF/safetensors folder, builtin:<arch> or demo; omitted: "
                        "the full demo on all-MiniLM-L6-v2 (qtransform.cli.demo)")
    s.add_argument("--format", help="format to scan (e.g. mxfp4); optional with --policy")
    s.add_argument("--policy", help="policy JSON: quantize rules select sites (and formats), "
                                    "instrument.thresholds flag problems")
    s.add_argument("--calib", metavar="FILE",
                   help="activation scan on calibration data: a text file (one sample per line), "
                        "a .json list of strings or token-id lists, or 'builtin'")
    s.add_argument("--sequential", action="store_true",
                   help="with --calib: run a checkpoint folder one decoder layer at a time (models "
                        "larger than memory; Llama/Qwen2-style causal LMs, same report)")
    s.add_argument("--out", help="folder for report.json/.csv/.md/.png (required with MODEL; "
                                 "the demo's default: ./qtransform-demo)")
    s.add_argument("--force", action="store_true",
                   help="replace --out even when it is a folder qtransform did not write")
    s.add_argument("--threshold", action="append", default=[], metavar="KEY=VALUE",
                   help="override a threshold: sqnr_db, deadzone, saturation, relative_error "
                        "(absolute); sqnr_margin_db, deadzone_margin, saturation_margin, outlier_z, "
                        "outlier_min_db (expected)")
    add_flagging(s)
    s.add_argument("--fail-on-problematic", action="store_true",
                   help="exit 1 when any site is problematic")
    s.add_argument("--no-onnx", action="store_true",
                   help="demo only: skip the ONNX export (its slowest step)")
    add_common(s)
    s.set_defaults(func=run_scan)

    c = sub.add_parser("compare", help="several formats side by side over the same weights",
                       epilog=EPILOG_COMPARE, formatter_class=raw)
    c.add_argument("model", help="safetensors file, HF/safetensors folder, builtin:<arch> or demo")
    c.add_argument("--formats", required=True, help="comma-separated formats")
    c.add_argument("--policy", help="policy JSON whose quantize rules select the sites")
    c.add_argument("--out", help="folder for comparison.json and comparison.md")
    c.add_argument("--force", action="store_true",
                   help="replace --out even when it is a folder qtransform did not write")
    add_common(c)
    c.set_defaults(func=run_compare)

    g = sub.add_parser("guide", help="turn a scan report into a policy (mixed precision / AQN)",
                       epilog=EPILOG_GUIDE, formatter_class=raw)
    g.add_argument("report", help="report.json, or the folder `qtransform scan` wrote")
    g.add_argument("--out", required=True, help="policy JSON file to write")
    g.add_argument("--tiers", default="1.5,1.2,1.0",
                   help="AQN sigma multipliers by SQNR group, worst first (default 1.5,1.2,1.0)")
    g.add_argument("--total-steps", type=int, default=1000, help="training steps of the AQN schedule")
    g.add_argument("--aqn", action="store_true",
                   help="always add SRDD-guided AQN and keep the scanned format")
    g.set_defaults(func=run_guide)


def _source(model: str) -> Any:
    """A module for builtin/demo models, else the checkpoint path (scanned tensor by tensor)."""
    if model.startswith("builtin:") or model == "demo":
        from qtransform.models import load_model

        return load_model(model)
    if not Path(model).exists():
        from qtransform.models import missing_source

        raise missing_source(model, "file or folder")
    return model


def run_scan(args: argparse.Namespace) -> int:
    from qtransform.core import io as qio
    from qtransform.models import input_paths
    from qtransform.scan.weights import scan_weights

    if args.model is None:
        from qtransform.cli.demo import run_from_args

        return run_from_args(args)
    if args.out is None:
        raise UserError("give --out FOLDER for the report files")
    if args.format is None and args.policy is None:
        raise UserError("give --format (e.g. --format mxfp4) or a --policy with quantize rules")
    if args.policy is not None and not Path(args.policy).exists():
        raise UserError(f"{args.policy}: no such policy file")
    with qio.output_folder(args.out, "scan", force=args.force,
                           protect=input_paths(args.model, args.policy, args.calib)) as staging:
        if args.sequential and args.calib is None:
            raise UserError("--sequential is a mode of the activation scan: give --calib too")
        if args.calib is not None:
            report = _activation_scan(args)
        else:
            report = scan_weights(_source(args.model), args.format, policy=args.policy,
                                  options=format_options(args), thresholds=thresholds(args.threshold),
                                  flagging=flagging(args), progress=progress(args))
        files = report.save(staging)
    if args.json:
        print(report.to_json())
    else:
        print(scan_table(report))
        print(f"\nwrote {', '.join(str(Path(args.out) / p.name) for p in files.values())}")
    return 1 if args.fail_on_problematic and report.problems() else 0


def _activation_scan(args: argparse.Namespace):
    """The --calib branch: run the model on calibration text or token ids (`--calib builtin`: the
    demo's sentences) and scan weights, activations and each site's output error."""
    from qtransform.calibration import builtin_calibration, read_calibration
    from qtransform.models import load_model, load_tokenizer
    from qtransform.scan.activations import cli_policy, scan_activations

    builtin = args.calib == "builtin" and not Path(args.calib).exists()
    calib = builtin_calibration() if builtin else read_calibration(args.calib)
    if args.sequential:
        from qtransform.scan.sequential import scan_sequential, skeleton

        if not Path(args.model).is_dir():
            raise UserError(f"{args.model}: --sequential reads a checkpoint folder (config.json "
                            "and safetensors)")
        policy = cli_policy(skeleton(Path(args.model)), args.format, args.policy,
                            format_options(args))
        report = scan_sequential(args.model, policy, calib, tokenizer=load_tokenizer(args.model),
                                 progress=progress(args))
    else:
        model = load_model(args.model)
        policy = cli_policy(model, args.format, args.policy, format_options(args))
        report = scan_activations(model, policy, calib, tokenizer=load_tokenizer(args.model),
                                  progress=progress(args))
    report.meta["source"] = args.model
    report.meta["calibration"]["file"] = "builtin" if builtin else args.calib
    report.thresholds.update(thresholds(args.threshold))
    report.flagging = flagging(args)
    return report


def scan_table(report) -> str:
    """The terminal view: one line per layer, then sites outside layers, problems, advice."""
    from qtransform.scan.recommend import recommend
    from qtransform.scan.render import format_metric as fm

    head = f"{'layer':>5} {'sites':>5} {'SQNR dB':>8} {'worst site':<28} {'worst':>7} " \
           f"{'rel_rmse':>9} {'deadzone':>9} {'satur.':>8} {'bad':>4}"
    lines = [f"{report.meta.get('format')} scan of {report.meta.get('source')} "
             f"({len(report.rows)} sites)", head, "-" * len(head)]
    for e in report.layer_summary():
        worst = e["worst_site"].partition(f".{e['layer']}.")[2] or e["worst_site"]
        lines.append(f"{e['layer']:>5} {e['sites']:>5} {fm('sqnr_db', e['sqnr_db']):>8} {worst[-28:]:<28} "
                     f"{fm('sqnr_db', e['worst_sqnr_db']):>7} {fm('rel_rmse', e['rel_rmse']):>9} "
                     f"{fm('deadzone', e['deadzone']):>9} {fm('saturation', e['saturation']):>8} "
                     f"{e['problem_sites'] or '':>4}")
    for row in (r for r in report.rows if r.layer is None):
        m = row.metrics
        lines.append(f"{'-':>5} {1:>5} {fm('sqnr_db', m['sqnr_db']):>8} {row.label[-28:]:<28} "
                     f"{fm('sqnr_db', m['sqnr_db']):>7} {fm('rel_rmse', m['rel_rmse']):>9} "
                     f"{fm('deadzone', m['deadzone']):>9} {fm('saturation', m['saturation']):>8} "
                     f"{1 if report.row_problems(row) else '':>4}")
    problems = report.problems()
    if problems:
        lines += ["", f"problematic sites ({len(problems)}):"]
        lines += [f"  {row.label}: {'; '.join(why)}" for row, why in problems[:20]]
        if len(problems) > 20:
            lines.append(f"  ... and {len(problems) - 20} more (report.md lists all)")
    from qtransform.scan.render import end_to_end_text

    if end_to_end_text(report):
        lines += ["", "end to end: " + end_to_end_text(report)]
    lines += ["", f"flagging: {report.flagging}", "recommendation: " + recommend(report).text]
    return "\n".join(lines)


def run_compare(args: argparse.Namespace) -> int:
    from qtransform.core import io as qio
    from qtransform.models import input_paths
    from qtransform.scan import compare_formats

    names = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not names:
        raise UserError("--formats needs at least one format, e.g. --formats mxfp4,nvfp4")
    if args.policy is not None and not Path(args.policy).exists():
        raise UserError(f"{args.policy}: no such policy file")
    with ExitStack() as stack:
        staging = None if args.out is None else stack.enter_context(qio.output_folder(
            args.out, "compare", force=args.force, protect=input_paths(args.model, args.policy)))
        result = compare_formats(_source(args.model), names, policy=args.policy,
                                 options=format_options(args), progress=progress(args))
        if staging is not None:
            qio.write_json(staging / "comparison.json", result.to_dict())
            qio.write_text(staging / "comparison.md", result.to_markdown())
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.to_markdown().rstrip())
    return 0


def _tiers(text: str) -> tuple[float, ...]:
    """--tiers: sigma multipliers, each finite and in (0, MAX_TIER]."""
    try:
        tiers = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise UserError(f"--tiers {text!r}: expected comma-separated numbers, e.g. 1.5,1.2,1.0") from None
    bad = [t for t in tiers if not 0 < t <= MAX_TIER]  # also catches nan
    if bad:
        raise UserError(f"--tiers: {bad[0]!r} is not a multiplier in (0, {MAX_TIER:g}]; "
                        "use values such as 1.5,1.2,1.0")
    return tiers


def run_guide(args: argparse.Namespace) -> int:
    from qtransform.core import io as qio
    from qtransform.scan.recommend import guide, recommend
    from qtransform.scan.report import ScanReport

    tiers = _tiers(args.tiers)
    if not 1 <= args.total_steps <= MAX_STEPS:
        raise UserError(f"--total-steps {args.total_steps}: give a step count from 1 to {MAX_STEPS}")
    with qio.output_file(args.out) as out:
        report = ScanReport.load(args.report)
        try:
            policy = guide(report, tiers, total_steps=args.total_steps, aqn=args.aqn)
            advice = recommend(report, tiers, total_steps=args.total_steps).text
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, UserError):
                raise
            raise UserError(f"{args.report}: the report does not fit this qtransform version "
                            f"({type(exc).__name__}: {exc}); re-run `qtransform scan`") from None
        qio.write_json(out, policy)
    print(advice, file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
