"""Options shared by the scan commands and the demo: format options, thresholds, progress."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from qtransform.errors import UserError
from qtransform.formats import suggest
from qtransform.formats.options import CHOICE_OPTIONS
from qtransform.scan.problems import ABSOLUTE_THRESHOLDS, DEFAULT_THRESHOLDS, FLAGGING

if TYPE_CHECKING:
    from torch import nn


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, help="elements per block (default: the format's)")
    p.add_argument("--granularity", help="what one scale covers: block (default), channel, "
                   "token, tensor (int and fp8 formats)")
    p.add_argument("--scale-rule", help="MX scale rule: floor (default), rceil, ceil, even, "
                   "compressed-tensors")
    p.add_argument("--rounding", help="rne (default), rna, rtz (toward zero) or stochastic")
    p.add_argument("--nvfp4-variant", help="NVFP4: default, compressed-tensors, one_level, modelopt")
    p.add_argument("--int-range", help="int4/int8: restricted (default, amax/qmax) or full "
                   "(compressed-tensors' amax/(qmax+0.5))")
    p.add_argument("--scale-dtype", help="int and fp8: float32 (default), bfloat16, float16, "
                   "input (the tensor's dtype)")
    p.add_argument("--fp8-variant", help="fp8: default (x / (amax/max)) or modelopt")
    p.add_argument("--four-over-six", help="nvfp4: mse or mae = keep the better of the max/6 "
                   "and max/4 block scales (default: max/6 only)")
    p.add_argument("--global-bound", help="nvfp4: the E4M3 value the tensor amax maps to, 448 "
                   "(default) or 256")
    p.add_argument("--four-over-six-order", help="nvfp4 four over six: pairwise (default), "
                   "transformer-engine, flashinfer or fouroversix (whose fp32 order decides)")
    p.add_argument("--json", action="store_true", help="print JSON on stdout instead of tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def format_options(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("block_size", "granularity", *CHOICE_OPTIONS)  # the CLI has no 2D tiles
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def thresholds(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in DEFAULT_THRESHOLDS:
            raise UserError(f"unknown threshold {key!r}{suggest(key, list(DEFAULT_THRESHOLDS))}; "
                            f"known: {', '.join(DEFAULT_THRESHOLDS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise UserError(f"threshold {key}: {value[:40]!r} is not a number") from None
        if not math.isfinite(out[key]):
            raise UserError(f"threshold {key}: {value!r} is not a finite number; give e.g. "
                            f"{key}={DEFAULT_THRESHOLDS[key]:g}")
    return out


def add_flagging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flag-by", choices=FLAGGING, default=None,
                   help="expected (default): flag sites worse than the format does on Gaussian data "
                        "of their block structure, or outliers among the model's sites; absolute: "
                        "fixed thresholds (implied when --threshold sets sqnr_db, deadzone, "
                        "saturation or relative_error)")


def flagging(args: argparse.Namespace) -> str:
    """--flag-by, else "absolute" when an absolute threshold was given (it would do nothing in the
    expected mode), else "expected"."""
    if args.flag_by is not None:
        return args.flag_by
    given = {item.partition("=")[0] for item in args.threshold}
    return "absolute" if given & set(ABSOLUTE_THRESHOLDS) else "expected"


def progress(args: argparse.Namespace) -> bool | None:
    return False if args.no_progress else None  # None: bars only when stderr is a terminal


CALIB_HELP = ("calibration data for the policy's static scales (scale_source \"static\"): a text "
              "file (one sample per line), a .json list of strings or token-id lists, or 'builtin'")


def add_calib(p: argparse.ArgumentParser) -> None:
    """`--calib FILE`: the samples that calibrate static scales (the scan's --calib format)."""
    p.add_argument("--calib", metavar="FILE", help=CALIB_HELP)


def calib_batches(source: str | None, model_path: str, model: nn.Module) -> list[Any] | None:
    """The padding-free token batches of `--calib` for `model` (text through the tokenizer saved
    beside `model_path`); None without --calib."""
    if source is None:
        return None
    from qtransform.calibration import CalibrationSpec
    from qtransform.models import load_tokenizer

    return CalibrationSpec.read(source, tokenizer=load_tokenizer(model_path)).batches(model)
