"""Activation scans: what quantization does to a model's activations on calibration data.

The quantized model (with taps, `passes/instrument.py`) and the full-precision model run on the
same batches. Per instrumented site the report holds

- rows `weight` / `input`: the quantization error of the quantized tensor itself;
- rows `query` / `key` / `value` / `probs` of attention sites: the same for those tensors, with
  each head's metrics in the row's `heads` (GQA: key/value heads for key and value);
- on key/value rows of a KV rule, `remedies`: the same tensors under the finer KV scales of
  its ladder (per head, per token and head; `scan/kv_remedy.py`), which `recommend` weighs;
- row `output`: the site's *local* error (shadow taps: its output against the full-precision
  product of the same site on the same input), which ranks sites by the error they add;
- `meta["accumulated"]`: the site's output in the quantized model against the same site's output
  in the full-precision model, everything upstream included;
- `meta["end_to_end"]`: next-token loss and perplexity of both models for causal LMs; for other
  models (encoders such as BERT, plain torch models) the SQNR and mean per-token cosine of the
  final output.

Everything streams: full-precision site outputs of one batch wait only until the quantized model
produces the same site's output, and only float64 sums outlive a batch (`scan/measure.py`). The
setup every scan shares (policy, calibration, the transformed copy) is `scan/setup.py`; the SRDD
field notes' fault-diagnosis scans (gain, kurtosis, instability) are in `scan/faults.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from qtransform.calibration import Calibration, run_model
from qtransform.core.progress import Progress
from qtransform.passes.instrument import Tap, reset_taps, tapping, taps
from qtransform.scan.kv_remedy import Ladder, attach_alternatives, calibrate_alternatives, remedies
from qtransform.scan.measure import (
    EndToEnd,
    SitePairs,
    build_report,
    pairs_table,
    site_quantizer,
    site_row,
)
from qtransform.scan.report import ScanReport
from qtransform.scan.setup import CalibrationSpec, ScanSetup, eval_mode, prepare_scan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qtransform.schemas import PolicyLike


def scan_activations(model: nn.Module, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *,
                     tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8, max_length: int = 128,
                     token_stride: int | None = None, progress: bool | None = False) -> ScanReport:
    """Scan a model's activations under a policy (or a bare format name) on calibration data.

    `model` is the full-precision model; it is left as it was (the scan transforms a copy and
    hooks the original only while it runs). `calib`: token ids (a [N, T] tensor or lists), text
    (with `tokenizer`), or a float tensor of inputs for plain torch models; or a
    `CalibrationSpec`, which carries its own tokenizer, batch size and length. Rows: quantized
    weights and inputs, and each site's local (shadow) error at its output; `meta` adds the
    accumulated error per site and the end-to-end comparison. Activation metrics use every
    `token_stride`-th token (1: all), which divides the cost of measuring (docs/benchmarks.md);
    None measures every token of small sets and about 1/16 of large ones (`auto_stride`).
    """
    spec = CalibrationSpec.of(calib, tokenizer, batch_size, max_length)
    setup = prepare_scan(model, policy_or_format, spec)
    quant = setup.quant
    stride = setup.stride(token_stride)
    end = EndToEnd(setup.causal, stride)
    reset_taps(quant)
    ladders = attach_alternatives(setup.program, setup.policy, taps(quant))
    calibrate_alternatives(quant, setup.policy, setup.batches)
    with eval_mode(model), SitePairs(model, quant, setup.sites, stride, setup.site_modules()) as pairs, \
            tapping(quant, True, stride=stride) as found, torch.no_grad():
        for batch in Progress(setup.batches, desc="activation scan", unit="batch", enabled=progress):
            fp_out = run_model(model, batch)
            q_out = run_model(quant, batch)
            pairs.end_batch()
            end.update(batch, fp_out, q_out)
    return activation_report(setup, found, pairs, end, stride, ladders)


def activation_report(setup: ScanSetup, found: list[Tap], pairs: SitePairs, end: EndToEnd,
                      token_stride: int, ladders: dict[str, Ladder] | None = None) -> ScanReport:
    """The report of a finished scan (in memory or layer by layer: `scan/sequential.py`);
    `ladders`: the KV alternatives the taps measured (tap label -> its ladder)."""
    program = setup.program
    by_site: dict[str, dict[str, Tap]] = {}
    for tap in found:
        by_site.setdefault(tap.site, {})[tap.point] = tap
    rows = []
    for name, site_taps in by_site.items():
        site = program.sites[name]
        for point, tap in site_taps.items():
            if tap.local is not None and tap.local.n:  # the site's own error, output quant included
                rows.append(site_row(site, point, tap.local, site_quantizer(program, name),
                                     experts=tap.experts()))
            elif tap.stats.n:
                exps = tap.exponents.result() if tap.exponents is not None else None
                row = site_row(site, point, tap.stats, tap.quantizer, block_exponents=exps,
                               experts=tap.experts(), heads=tap.heads())
                if ladders and tap.label in ladders:
                    row.remedies = remedies(tap, ladders[tap.label])
                rows.append(row)
    return build_report(
        "activation_scan", program, setup.policy, rows, end_to_end=end.result(),
        accumulated=pairs_table(program, pairs.stats),
        calibration=setup.calibration_meta(token_stride=token_stride))
