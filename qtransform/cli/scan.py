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

from qtransform.calibration import CalibrationSpec, read_source
from qtransform.cli.demo import run_from_args
from qtransform.cli.options import (
    add_common,
    add_flagging,
    flagging,
    format_options,
    progress,
    thresholds,
)
from qtransform.cli.sensitivity import add_budget, budget_args, budget_text
from qtransform.core import io as qio
from qtransform.errors import UserError, missing_source
from qtransform.models import input_paths, load_model, load_tokenizer
from qtransform.report.page import page_beside
from qtransform.report.scan_pages import (
    command_line,
    compare_page,
    guide_page,
    link_to,
    write_scan_page,
)
from qtransform.scan import compare_formats
from qtransform.scan.activations import scan_activations
from qtransform.scan.budget import budget_guide
from qtransform.scan.grid import grid_line
from qtransform.scan.recommend import guide, recommend
from qtransform.scan.render import end_to_end_text
from qtransform.scan.render import format_metric as fm
from qtransform.scan.report import ScanReport
from qtransform.scan.sensitivity_report import SensitivityReport
from qtransform.scan.sequential import scan_sequential, skeleton
from qtransform.scan.setup import scan_policy
from qtransform.scan.weights import scan_weights

MAX_TIER = 100.0  # an AQN sigma multiplier beyond this drowns the weights in noise
MAX_STEPS = 10**9

EPILOG_SCAN = """examples:
  qtransform scan                     # the demo: all-MiniLM-L6-v2, MXFP4 vs NVFP4, ONNX
  qtransform scan ./Qwen2.5-1.5B --format mxfp4 --out scans/mxfp4
  qtransform scan model.safetensors --format mxfp4 --scale-rule rceil --out scans/rceil --json
  qtransform scan ./Qwen2.5-1.5B --policy policy.json --out scans/p --fail-on-problematic
"""
EPILOG_COMPARE = """examples:
  qtransform compare ./Qwen2.5-1.5B --formats mxfp4,nvfp4,mxfp8_e4m3
  qtransform compare ./Qwen2.5-1.5B --formats nvfp4,nvfp4:four_over_six=mse   # + share of max/4 blocks
"""
EPILOG_GUIDE = """examples:
  qtransform guide scans/mxfp4/report.json --out policy.json
  qtransform guide scans/mxfp4 --out aqn.json --aqn --tiers 1.5,1.2,1.0 --total-steps 174
  qtransform guide scans/mxfp4 --out p.json --bits 5 --sensitivity sens/mxfp4     # ranking read
  qtransform guide scans/mxfp4 --out p.json --keep 10% --model ./Qwen2.5-0.5B --calib calib.txt
                                                                    # ranking computed (exact KL)

With a budget (--bits, --keep or --kl-target, as in `qtransform sensitivity`) guide keeps the sites
whose one-at-a-time end-to-end sensitivity is largest within the budget, and prints the predicted
(sum of the quantized sites' sensitivities) and the measured (the whole policy run once) KL per
token, or output nsr for encoders. The ranking is read from --sensitivity (sensitivity.json, as
`qtransform sensitivity` writes it) or, without it, computed here: the exact measure, one run of the
calibration set per site of the report's quantize rules, on --model with --calib.

Without a budget, a sensitivity measurement of the same run (--sensitivity, or sensitivity.json
in the report's folder) makes the recommendation keep the sites it ranks highest (as many as the
weight scan would keep) and say where the weight-error view disagrees.
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
    s.add_argument("--rotation", metavar="ROT",
                   help="weight scan: also measure each weight rotated along its reduction axis "
                        "(hadamard-32, random_hadamard-64:SEED, hadamard = the whole axis); the "
                        "report shows the gain and `guide` proposes a rotate rule where it heals")
    s.add_argument("--four-over-six-remedy", metavar="MODES", default="mse",
                   help="weight scan of plain NVFP4: also measure four over six (mse, mae, mse,mae; "
                        "none: skip) on every weight, with its share of max/4 blocks; `guide` "
                        "proposes it where it clears flagged sites (default: mse)")
    s.add_argument("--fail-on-problematic", action="store_true",
                   help="exit 1 when any site is problematic")
    s.add_argument("--no-onnx", action="store_true",
                   help="demo only: skip the ONNX export (its slowest step)")
    add_common(s)
    s.set_defaults(func=run_scan)

    c = sub.add_parser("compare", help="several formats side by side over the same weights",
                       epilog=EPILOG_COMPARE, formatter_class=raw)
    c.add_argument("model", help="safetensors file, HF/safetensors folder, builtin:<arch> or demo")
    c.add_argument("--formats", required=True,
                   help="comma-separated formats, each with its own options if needed: "
                        "FORMAT:OPTION=VALUE[:OPTION=VALUE] (e.g. nvfp4,nvfp4:four_over_six=mse)")
    c.add_argument("--policy", help="policy JSON whose quantize rules select the sites")
    c.add_argument("--rotation", metavar="ROT",
                   help="add a column 'FORMAT with ROT' beside each format: the weights rotated "
                        "along their reduction axis first (e.g. hadamard-32)")
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
    b = g.add_argument_group("budgeted mixed precision (one budget, as in `qtransform sensitivity`)")
    add_budget(b)
    b.add_argument("--sensitivity", metavar="FILE",
                   help="sensitivity.json (or its folder) written by `qtransform sensitivity`: the "
                        "site ranking the budget reads; without it the exact ranking is computed "
                        "from the report's quantize rules on --model with --calib. Without a "
                        "budget: the ranking the recommendation follows (default: "
                        "sensitivity.json in the report's folder)")
    b.add_argument("--model", help="the scanned model (HF folder, builtin:<arch>, demo): computes the "
                                   "ranking and measures the chosen policy (default: the model "
                                   "the --sensitivity file names)")
    b.add_argument("--calib", metavar="FILE",
                   help="calibration data for both: text file, .json strings or id lists, or "
                        "'builtin' (default: the --sensitivity file's)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    g.set_defaults(func=run_guide)


def _source(model: str) -> Any:
    """A module for builtin/demo models, else the checkpoint path (scanned tensor by tensor)."""
    if model.startswith("builtin:") or model == "demo":
        return load_model(model)
    if not Path(model).exists():
        raise missing_source(model, "file or folder")
    return model


def run_scan(args: argparse.Namespace) -> int:
    if args.model is None:
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
        if args.rotation and args.calib is not None:
            raise UserError("--rotation is measured by the weight scan: drop --calib, or measure a "
                            "rotation end to end with `qtransform sensitivity --rotation`")
        if args.calib is not None:
            report = _activation_scan(args)
            # the weights again, for the page's histograms: cheap for a checkpoint or builtin
            source = _source(args.model) if Path(args.model).exists() or \
                args.model.startswith("builtin:") else None
        else:
            source = _source(args.model)
            report = scan_weights(source, args.format, policy=args.policy,
                                  options=format_options(args), thresholds=thresholds(args.threshold),
                                  flagging=flagging(args), progress=progress(args),
                                  rotation=args.rotation,
                                  four_over_six=_fos_modes(args.four_over_six_remedy))
        files = report.save(staging)
        files["html"] = write_scan_page(report, staging / "report.html", source=source,
                                        command=command_line())
    if args.json:
        print(report.to_json())
    else:
        print(scan_table(report))
        print(f"\nwrote {', '.join(str(Path(args.out) / p.name) for p in files.values())}")
    return 1 if args.fail_on_problematic and report.problems() else 0


def _fos_modes(text: str) -> tuple[str, ...]:
    """--four-over-six-remedy: 'mse', 'mae', 'mse,mae' or 'none'."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if modes == ("none",):
        return ()
    if not modes or any(m not in ("mse", "mae") for m in modes):
        raise UserError(f"--four-over-six-remedy {text!r}: give mse, mae, mse,mae or none")
    return tuple(dict.fromkeys(modes))


def _activation_scan(args: argparse.Namespace):
    """The --calib branch: run the model on calibration text or token ids (`--calib builtin`: the
    demo's sentences) and scan weights, activations and each site's output error."""
    samples = read_source(args.calib)
    if args.sequential:
        if not Path(args.model).is_dir():
            raise UserError(f"{args.model}: --sequential reads a checkpoint folder (config.json "
                            "and safetensors)")
        policy = scan_policy(skeleton(Path(args.model)), args.format, args.policy,
                             options=format_options(args))
        calib = CalibrationSpec(samples, load_tokenizer(args.model), source=args.calib)
        report = scan_sequential(args.model, policy, calib, progress=progress(args))
    else:
        model = load_model(args.model)
        policy = scan_policy(model, args.format, args.policy, options=format_options(args))
        calib = CalibrationSpec(samples, load_tokenizer(args.model), source=args.calib)
        report = scan_activations(model, policy, calib, progress=progress(args))
    report.meta["source"] = args.model
    report.thresholds.update(thresholds(args.threshold))
    report.flagging = flagging(args)
    return report


def scan_table(report: ScanReport) -> str:
    """The terminal view: one line per layer, then sites outside layers, problems, advice."""
    head = f"{'layer':>5} {'point':<6} {'sites':>5} {'SQNR dB':>8} {'worst site':<28} {'worst':>7} " \
           f"{'rel_rmse':>9} {'deadzone':>9} {'satur.':>8} {'bad':>4}"
    lines = [f"{report.meta.get('format')} scan of {report.meta.get('source')} "
             f"({len(report.rows)} sites)", head, "-" * len(head)]
    for e in report.layer_summary():  # one line per layer and point kind: never pooled
        worst = e["worst_site"].partition(f".{e['layer']}.")[2] or e["worst_site"]
        lines.append(f"{e['layer']:>5} {e['point']:<6} {e['sites']:>5} {fm('sqnr_db', e['sqnr_db']):>8} "
                     f"{worst[-28:]:<28} {fm('sqnr_db', e['worst_sqnr_db']):>7} "
                     f"{fm('rel_rmse', e['rel_rmse']):>9} {fm('deadzone', e['deadzone']):>9} "
                     f"{fm('saturation', e['saturation']):>8} {e['problem_sites'] or '':>4}")
    for row in (r for r in report.rows if r.layer is None):
        m = row.metrics
        lines.append(f"{'-':>5} {row.point:<6} {1:>5} {fm('sqnr_db', m['sqnr_db']):>8} {row.site[-28:]:<28} "
                     f"{fm('sqnr_db', m['sqnr_db']):>7} {fm('rel_rmse', m['rel_rmse']):>9} "
                     f"{fm('deadzone', m['deadzone']):>9} {fm('saturation', m['saturation']):>8} "
                     f"{1 if report.row_problems(row) else '':>4}")
    if grid := grid_line(report.meta.get("grids") or {}):
        lines += ["", grid]
    problems = report.problems()
    if problems:
        lines += ["", f"problematic sites ({len(problems)}):"]
        lines += [f"  {row.label}: {'; '.join(why)}" for row, why in problems[:20]]
        if len(problems) > 20:
            lines.append(f"  ... and {len(problems) - 20} more (report.md lists all)")
    if end_to_end_text(report):
        lines += ["", "end to end: " + end_to_end_text(report)]
    lines += ["", f"flagging: {report.flagging}", "recommendation: " + recommend(report).text]
    return "\n".join(lines)


def run_compare(args: argparse.Namespace) -> int:
    names = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not names:
        raise UserError("--formats needs at least one format, e.g. --formats mxfp4,nvfp4")
    if args.policy is not None and not Path(args.policy).exists():
        raise UserError(f"{args.policy}: no such policy file")
    with ExitStack() as stack:
        staging = None if args.out is None else stack.enter_context(qio.output_folder(
            args.out, "compare", force=args.force, protect=input_paths(args.model, args.policy)))
        result = compare_formats(_source(args.model), names, policy=args.policy,
                                 options=format_options(args), progress=progress(args),
                                 rotation=args.rotation)
        if staging is not None:
            result.save(staging)
            compare_page(result, command=command_line()).write(staging / "comparison.html")
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.markdown().rstrip())
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


def scan_link(report: str, out: str) -> list[tuple[str, str]]:
    """The guide page's link to the page of the scan it read (when that page exists)."""
    folder = Path(report) if Path(report).is_dir() else Path(report).parent
    return link_to(folder / "report.html", page_beside(out), "the scan this policy comes from")


def run_guide(args: argparse.Namespace) -> int:
    qio.check_file_target(page_beside(args.out))  # the page beside the policy, before any work
    budget = budget_args(args)
    if budget is not None:
        if args.aqn:
            raise UserError("--aqn and a budget (--bits/--keep/--kl-target) are two different "
                            "policies: give one of them")
        return _budget_guide(args, budget)
    if args.model or args.calib:
        raise UserError("--model and --calib go with a budget: add --bits B, --keep N|P% or "
                        "--kl-target T")
    tiers = _tiers(args.tiers)
    if not 1 <= args.total_steps <= MAX_STEPS:
        raise UserError(f"--total-steps {args.total_steps}: give a step count from 1 to {MAX_STEPS}")
    with qio.output_file(args.out) as out:
        report = ScanReport.load(args.report)  # the user's data is checked here, once
        found = args.sensitivity or beside(args.report)
        sens = SensitivityReport.load(found) if found else None
        policy = guide(report, tiers, total_steps=args.total_steps, aqn=args.aqn, sensitivity=sens)
        advice = recommend(report, tiers, total_steps=args.total_steps, sensitivity=sens).text
        qio.write_json(out, policy)
        guide_page(report, policy, advice, command=command_line(),
                   links=scan_link(args.report, args.out)).write(page_beside(args.out))
    if found:
        print(f"sites ranked by the sensitivity in {found}", file=sys.stderr)
    print(advice, file=sys.stderr)
    if "noise" in policy:
        print("AQN's sigma is absolute: `qtransform plan MODEL POLICY` shows it against each norm's "
              'mean |w| (and its extremes); "sigma_scale": "mean_abs" makes it relative',
              file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def beside(report: str) -> str | None:
    """sensitivity.json in the scan report's folder (the same run), if there is one."""
    folder = Path(report) if Path(report).is_dir() else Path(report).parent
    path = folder / "sensitivity.json"
    return str(path) if path.is_file() else None


def _budget_guide(args: argparse.Namespace, budget: dict[str, Any]) -> int:
    """guide with a budget (`qtransform.scan.budget.budget_guide`, see EPILOG_GUIDE): the
    model and calibration data come from the options, else from the --sensitivity file."""
    with qio.output_file(args.out) as out:
        report = ScanReport.load(args.report)
        sens = SensitivityReport.load(args.sensitivity) if args.sensitivity else None
        meta = sens.meta if sens is not None else {}
        calibration = meta.get("calibration") or {}
        model_spec = args.model or meta.get("source")
        calib_spec = args.calib or calibration.get("file")
        if model_spec is None or calib_spec is None:
            raise UserError("a budget needs the model and calibration data to measure the policy "
                            "on: give --model and --calib (or a --sensitivity file that names them)")
        calib = CalibrationSpec.read(calib_spec, tokenizer=load_tokenizer(model_spec),
                                     batch_size=int(calibration.get("batch_size", 8)),
                                     max_length=int(calibration.get("max_length", 128)))
        result, sens = budget_guide(report, budget, load_model(model_spec), calib, sensitivity=sens,
                                    progress=progress(args))
        qio.write_json(out, result.policy)
        guide_page(report, result.policy, budget_text(result, sens.measure), command=command_line(),
                   links=scan_link(args.report, args.out)).write(page_beside(args.out))
    print(("ranking read from " + args.sensitivity) if args.sensitivity else
          f"ranking computed: exact {sens.measure} of {len(sens.rows)} sites on {model_spec}", file=sys.stderr)
    print(budget_text(result, sens.measure), file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
