"""Activation scans: what quantization does to a model's activations on calibration data.

The quantized model (with taps, `passes/instrument.py`) and the full-precision model run on the
same batches. Per instrumented site the report holds

- rows `weight` / `input`: the quantization error of the quantized tensor itself;
- row `output`: the site's *local* error (shadow taps: its output against the full-precision
  product of the same site on the same input), which ranks sites by the error they add;
- `meta["accumulated"]`: the site's output in the quantized model against the same site's output
  in the full-precision model, everything upstream included;
- `meta["end_to_end"]`: next-token loss and perplexity of both models for causal LMs; for other
  models (encoders such as BERT, plain torch models) the SQNR and mean per-token cosine of the
  final output.

Everything streams: full-precision site outputs of one batch wait only until the quantized model
produces the same site's output, and only float64 sums outlive a batch. The SRDD field notes'
fault-diagnosis scans (gain, kurtosis, instability) are in `qtransform.fault_scan`.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qtransform import formats
from qtransform.calibration import Calibration, calibration_batches, run_model
from qtransform.core.metrics import ErrorStats
from qtransform.core.sites import Site, discover_sites
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.passes import FakeQuantPass
from qtransform.passes.instrument import (
    Tap,
    next_offset,
    quantizer,
    reset_taps,
    sample_rows,
    tapping,
)
from qtransform.pipeline import plan, transform_program
from qtransform.scan.report import ScanReport, SiteRow, build_meta
from qtransform.scan.weights import (
    policy_rules,
    policy_thresholds,
    source_label,
)
from qtransform.schemas import InstrumentSpec, Policy, dump_policy, load_policy


def progress_bar(batches: list[Tensor], enabled: bool | None, what: str) -> Iterable[Tensor]:
    """A progress bar on stderr; `None` shows it only when stderr is a terminal."""
    from tqdm.auto import tqdm

    return tqdm(batches, desc=what, unit="batch", disable=None if enabled is None else not enabled,
                leave=False)


# -- policies ------------------------------------------------------------------------------------
def format_policy(model: nn.Module, fmt: str, options: dict[str, Any] | None = None) -> Policy:
    """What a bare format name means: W4A16-style weight quantization of every linear site except
    the LM head (which quantization recipes keep in high precision), with `options` (block_size,
    scale_rule, rounding, nvfp4_variant) set on the rule."""
    heads = [s.name for s in discover_sites(model).values() if s.role == "lm_head"]
    rule = {"name": fmt, "targets": ["Linear"], "ignore": heads, "format": fmt,
            "tensors": ["weight"], **(options or {})}
    return load_policy({"version": 1, "quantize": [rule]})


def cli_policy(model: nn.Module, fmt: str | None, policy: Any, options: dict[str, Any]) -> Policy:
    """The policy `qtransform scan --calib` means: like the weight scan, a policy's rules select
    the sites and `--format` (with the format options), when given, replaces their format."""
    if policy is None:
        if fmt is None:
            raise UserError("give --format (e.g. --format mxfp4) or a --policy with quantize rules")
        return format_policy(model, fmt, options)
    data = dump_policy(load_policy(policy))
    for rule in data["quantize"]:
        rule.update({"format": fmt} if fmt else {}, **options)
    return load_policy(data)


def resolve_policy(model: nn.Module, policy_or_format: Any) -> Policy:
    """A Policy (or format name) with an instrument section; without one, every quantized site
    is instrumented at every point."""
    known = isinstance(policy_or_format, str) and policy_or_format.lower() in formats.names()
    policy = format_policy(model, policy_or_format) if known else load_policy(policy_or_format)
    if policy.instrument is not None:
        return policy
    quantized = list(dict.fromkeys(r.site for r in plan(model, policy).rows if r.pass_name == FakeQuantPass.name))
    if not quantized:
        raise UserError("the policy quantizes nothing and has no instrument section: "
                        "nothing to scan")
    exact = [f"re:{re.escape(name)}" for name in quantized]
    return policy.model_copy(update={"instrument": InstrumentSpec(targets=exact)})


# -- streaming comparisons -----------------------------------------------------------------------
class ForwardHooks:
    """Forward hooks that are removed however the scan ends."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, module: nn.Module, hook: Callable) -> None:
        self._handles.append(module.register_forward_hook(hook))

    @contextmanager
    def registering(self) -> Iterator[None]:
        """Wrap the adding of hooks: if one fails (a module that is not there, say), those already
        added are removed, since the caller never reaches `with` and so never `__exit__`."""
        try:
            yield
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class SitePairs(ForwardHooks):
    """Accumulated error: each site's output in the quantized model against the same site's
    output in the full-precision model on the same batch.

    Run the full-precision model first: its site outputs wait (one batch, no more; only the
    sampled token rows when `stride` > 1, the same rows as the taps) until the quantized model
    produces the matching output, which is compared at once and dropped.
    """

    def __init__(self, fp: nn.Module, quant: nn.Module, sites: list[str], stride: int = 1,
                 modules: dict[str, str] | None = None):
        super().__init__()
        self.stats = {s: ErrorStats() for s in sites}
        self.stride = stride
        self._seen = {(model, s): 0 for model in ("fp", "quant") for s in sites}
        self._pending: dict[str, deque[Tensor]] = {s: deque() for s in sites}
        with self.registering():
            for site in sites:  # `modules`: an experts site is measured at its experts module
                path = (modules or {}).get(site, site)
                self.add(fp.get_submodule(path), self._keep(site))
                self.add(quant.get_submodule(path), self._compare(site))

    def _rows(self, model: str, site: str, output: Tensor | tuple) -> Tensor:
        if isinstance(output, tuple):  # a router's (logits, scores, indices): its logits
            output = output[0]
        offset = next_offset(self._seen[model, site], self.stride)
        self._seen[model, site] += output.numel() // output.shape[-1]
        return sample_rows(output.detach(), offset, self.stride)

    def _keep(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            rows = self._rows("fp", site, output)  # sampled rows are copied: the output is freed
            self._pending[site].append(rows if self.stride == 1 else rows.contiguous())
        return hook

    def _compare(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if not self._pending[site]:
                raise RuntimeError(f"{site}: the quantized model called it more often than the "
                                   "full-precision model")
            self.stats[site].update(self._pending[site].popleft(), self._rows("quant", site, output))
        return hook

    def end_batch(self) -> None:
        left = [s for s, q in self._pending.items() if q]
        if left:
            raise RuntimeError(f"sites ran in the full-precision model only: {', '.join(left)}")


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model that predicts the next token (gets loss and perplexity)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def primary_output(output: Any) -> Tensor:
    """Logits, else the last hidden state, else the first output."""
    if isinstance(output, Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, Tensor):
            return value
    return output[0]


class EndToEnd:
    """Whole-model comparison on the calibration data, as float64 sums.

    Causal LMs: next-token loss (mean over every predicted token) and perplexity = exp(loss) of
    both models. Every model: SQNR etc. of the final output (logits, or the last hidden state of
    an encoder) and the mean over tokens of the cosine between the fp and quantized output
    vectors, on every `stride`-th token like the site metrics.
    """

    def __init__(self, causal: bool, stride: int = 1):
        self.causal = causal
        self.stride = stride
        self.output = ErrorStats()
        self.nll = {"fp": 0.0, "quant": 0.0}
        self.predicted = 0
        self.cosine_sum = 0.0
        self.vectors = 0  # measured output vectors (every `stride`-th)
        self.vectors_seen = 0

    def update(self, batch: Tensor, fp_out: Any, q_out: Any) -> None:
        fp, q = primary_output(fp_out).detach(), primary_output(q_out).detach()
        offset = next_offset(self.vectors_seen, self.stride)
        self.vectors_seen += fp.numel() // fp.shape[-1]
        fp_rows, q_rows = (sample_rows(t, offset, self.stride) for t in (fp, q))
        self.output.update(fp_rows, q_rows)
        a, b = (t.double().reshape(-1, t.shape[-1]) for t in (fp_rows, q_rows))
        self.cosine_sum += float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).sum())
        self.vectors += a.shape[0]
        if self.causal:
            targets = batch[:, 1:].reshape(-1)
            for name, logits in (("fp", fp), ("quant", q)):
                pred = logits[:, :-1].float().reshape(-1, logits.shape[-1])
                self.nll[name] += float(torch.nn.functional.cross_entropy(pred, targets, reduction="sum"))
            self.predicted += targets.numel()

    def result(self) -> dict[str, Any]:
        out = self.output.result()
        res: dict[str, Any] = {
            "output": "logits" if self.causal else "final output",
            "sqnr_db": out["sqnr_db"], "rel_rmse": out["rel_rmse"], "cosine": out["cosine"],
            "mean_token_cosine": self.cosine_sum / self.vectors if self.vectors else math.nan,
            "tokens": self.vectors_seen, "measured_tokens": self.vectors,
        }
        if self.causal and self.predicted:
            for name in ("fp", "quant"):
                loss = self.nll[name] / self.predicted
                res[f"loss_{name}"], res[f"perplexity_{name}"] = loss, math.exp(loss)
            res["predicted_tokens"] = self.predicted
        return res


# -- reports -------------------------------------------------------------------------------------
def _features(site: Site, point: str) -> int:
    """Elements per token of a site's input or output (from its weight shape)."""
    matrix = site.weight_shape[-2:]  # an experts weight: each expert's matrix
    out_dim, in_dim = matrix[::-1] if site.weight_transposed else matrix
    return in_dim if point == "input" else out_dim


def site_row(site: Site, point: str, stats: ErrorStats, quantizer: QuantConfig | None, *,
         extra: dict[str, Any] | None = None, block_exponents: dict | None = None,
         experts: list[dict[str, Any]] | None = None) -> SiteRow:
    """A report row; activation rows have shape [tokens, features]."""
    options = {}
    if quantizer is not None:
        options = {k: v for k, v in quantizer.options().items() if k != "zero_saturated_grad"}
    if point == "weight":
        shape = list(site.weight_shape or ())
    else:
        features = _features(site, point)
        shape = [stats.n // features, features]
    row = SiteRow.from_stats(site.name, point, stats, layer=site.layer, role=site.role,
                             kind=site.kind, shape=shape, fmt=quantizer.name if quantizer else "none",
                             options=options,
                             block_exponents=block_exponents)
    row.metrics.update(extra or {})
    row.experts = experts
    return row


def site_quantizer(program: Any, site: str) -> QuantConfig | None:
    """The format a site's output error comes from: its weight's, else its input's, output's."""
    for point in ("weight", "input", "output"):
        found = quantizer(program, site, point)
        if found is not None:
            return found
    return None


def build_report(kind: str, program: Any, policy: Policy, rows: list[SiteRow],
                 **extra: Any) -> ScanReport:
    """A ScanReport with the policy's rules and thresholds, so recommendations start from them."""
    fmts = sorted({r.format for r in rows if r.format != "none"})
    single = len(fmts) == 1
    options = next((r.options for r in rows if r.format != "none"), {}) if single else {}
    meta = build_meta(kind=kind, source=source_label(program.model),
                      fmt=fmts[0] if single else "mixed", options=options,
                      quantize=policy_rules(policy), **extra)
    return ScanReport(meta=meta, rows=rows, thresholds=policy_thresholds(policy))


def _pairs_table(program: Any, stats: dict[str, ErrorStats]) -> list[dict[str, Any]]:
    return [{"site": name, "layer": program.sites[name].layer, "role": program.sites[name].role,
             "metrics": s.result(), "state": s.state()} for name, s in stats.items()]


# -- the activation scan -------------------------------------------------------------------------
def transform_for_scan(model: nn.Module, policy_or_format: Any) -> tuple[Any, Policy, list[str]]:
    """(Program of the transformed copy, the policy used, instrumented site names in order)."""
    policy = resolve_policy(model, policy_or_format)
    program = transform_program(model, policy)
    sites = list(dict.fromkeys(i.site for i in program.insertions(pass_name="instrument")))
    return program, policy, sites


MEASURED_TOKENS = 1024  # the automatic stride keeps at least this many tokens when it can
MAX_AUTO_STRIDE = 16  # taps within ~1.5x of the forward (docs/benchmarks.md)


def auto_stride(tokens: int) -> int:
    """Every token of a small calibration set (exact, and cheap in absolute terms); large sets
    sample up to every 16th token, keeping at least `MEASURED_TOKENS` of them."""
    return max(1, min(MAX_AUTO_STRIDE, tokens // MEASURED_TOKENS))


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The full-precision model in eval mode (no dropout) while scanning, then as it was: every
    submodule gets its own `training` flag back (a model may be in train mode with, say, frozen
    norms in eval mode, and `model.train(flag)` would flatten that)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield model.eval()
    finally:
        for module, training in flags:
            module.training = training


def scan_activations(model: nn.Module, policy_or_format: Any, calib: Calibration, *,
                     tokenizer: Any = None, batch_size: int = 8, max_length: int = 128,
                     token_stride: int | None = None, progress: bool | None = False) -> ScanReport:
    """Scan a model's activations under a policy (or a bare format name) on calibration data.

    `model` is the full-precision model; it is left as it was (the scan transforms a copy and
    hooks the original only while it runs). `calib`: token ids (a [N, T] tensor or lists), text
    (with `tokenizer`), or a float tensor of inputs for plain torch models. Rows: quantized
    weights and inputs, and each site's local (shadow) error at its output; `meta` adds the
    accumulated error per site and the end-to-end comparison. Activation metrics use every
    `token_stride`-th token (1: all), which divides the cost of measuring (docs/benchmarks.md);
    None measures every token of small sets and about 1/16 of large ones (`auto_stride`).
    """
    program, policy, sites = transform_for_scan(model, policy_or_format)
    quant = program.module()
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    if token_stride is None:
        token_stride = auto_stride(sum(b.numel() // b.shape[-1] if b.is_floating_point()
                                       else b.numel() for b in batches))
    end = EndToEnd(is_causal_lm(model), token_stride)
    reset_taps(quant)
    with eval_mode(model), SitePairs(model, quant, sites, token_stride,
                                                  {s: program.sites[s].module_name for s in sites}) as pairs, \
            tapping(quant, True, stride=token_stride) as found, torch.no_grad():
        for batch in progress_bar(batches, progress, "activation scan"):
            fp_out = run_model(model, batch)
            q_out = run_model(quant, batch)
            pairs.end_batch()
            end.update(batch, fp_out, q_out)
    return activation_report(program, policy, found, pairs, end, batches, batch_size=batch_size,
                             max_length=max_length, token_stride=token_stride)


def activation_report(program: Any, policy: Policy, found: list[Tap], pairs: SitePairs,
                      end: EndToEnd, batches: list[Tensor], *, batch_size: int, max_length: int,
                      token_stride: int) -> ScanReport:
    """The report of a finished scan (in memory or layer by layer: `scan/sequential.py`)."""
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
                rows.append(site_row(site, point, tap.stats, tap.quantizer, block_exponents=exps,
                                     experts=tap.experts()))
    return build_report(
        "activation_scan", program, policy, rows, end_to_end=end.result(),
        accumulated=_pairs_table(program, pairs.stats),
        calibration={"batches": len(batches), "samples": sum(len(b) for b in batches),
                     "batch_size": batch_size, "max_length": max_length,
                     "token_stride": token_stride})
