"""The measuring pieces every scan on calibration data shares: hooks that compare the two
models' values as they stream past, the end-to-end comparison, and report rows.

Everything streams: full-precision site outputs of one batch wait only until the quantized model
produces the same site's output, and only float64 sums outlive a batch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from qtransform.core.metrics import ErrorStats
from qtransform.core.sites import Site
from qtransform.formats import QuantConfig
from qtransform.passes.instrument import next_offset, quantizer, sample_rows
from qtransform.scan.report import ScanReport, SiteRow, build_meta
from qtransform.scan.seen import scale_groups
from qtransform.scan.setup import primary_output
from qtransform.scan.sources import source_label
from qtransform.scan.weights import policy_rules, policy_thresholds, rotate_rules
from qtransform.schemas import Policy

if TYPE_CHECKING:
    from qtransform.core.program import Program


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

    def update(self, batch: Tensor, fp_out: object, q_out: object) -> None:
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
def _features(site: Site, point: str) -> int | None:
    """Elements per token of a site's input or output (from its weight shape), of an attention
    site's query/key/value (head_dim: rows are (batch, head, token)); None where unknown."""
    if site.weight_shape is None:
        return site.heads[2] if site.heads and point in ("query", "key", "value") else None
    matrix = site.weight_shape[-2:]  # an experts weight: each expert's matrix
    out_dim, in_dim = matrix[::-1] if site.weight_transposed else matrix
    return in_dim if point == "input" else out_dim


def site_row(site: Site, point: str, stats: ErrorStats, quantizer: QuantConfig | None, *,
         extra: dict[str, Any] | None = None, block_exponents: dict | None = None,
         experts: list[dict[str, Any]] | None = None,
         heads: list[dict[str, Any]] | None = None) -> SiteRow:
    """A report row; activation rows have shape [tokens, features] (an attention site's
    query/key/value: [batch·heads·tokens, head_dim], probs and outputs: [elements])."""
    options = {}
    if quantizer is not None:
        options = {k: v for k, v in quantizer.options().items() if k != "zero_saturated_grad"}
    if point == "weight":
        shape = list(site.weight_shape or ())
    else:
        features = _features(site, point)
        shape = [stats.n] if features is None else [stats.n // features, features]
    row = SiteRow.from_stats(site.name, point, stats, layer=site.layer, role=site.role,
                             kind=site.kind, shape=shape, fmt=quantizer.name if quantizer else "none",
                             options=options,
                             block_exponents=block_exponents)
    row.metrics.update(extra or {})
    row.experts = experts
    row.heads = heads
    return row


def site_quantizer(program: Program, site: str) -> QuantConfig | None:
    """The format a site's output error comes from: its weight's, else its input's, output's."""
    for point in ("weight", "input", "output"):
        found = quantizer(program, site, point)
        if found is not None:
            return found
    return None


def build_report(kind: str, program: Program, policy: Policy, rows: list[SiteRow],
                 **extra: object) -> ScanReport:
    """A ScanReport with the policy's rules and thresholds, so recommendations start from them."""
    fmts = sorted({r.format for r in rows if r.format != "none"})
    single = len(fmts) == 1
    options = next((r.options for r in rows if r.format != "none"), {}) if single else {}
    rotate = rotate_rules(policy)
    groups = scale_groups(policy, list(program.sites.values()))
    meta = build_meta(kind=kind, source=source_label(program.model),
                      fmt=fmts[0] if single else "mixed", options=options,
                      quantize=policy_rules(policy), **({"rotate": rotate} if rotate else {}),
                      **({"scale_groups": groups} if groups else {}), **extra)
    return ScanReport(meta=meta, rows=rows, thresholds=policy_thresholds(policy))


def pairs_table(program: Program, stats: dict[str, ErrorStats]) -> list[dict[str, Any]]:
    return [{"site": name, "layer": program.sites[name].layer, "role": program.sites[name].role,
             "metrics": s.result(), "state": s.state()} for name, s in stats.items()]
