"""Instrument pass: taps on the weight, input and output of selected sites (SRDD scans).

A tap is an identity on the value it sits on. In eager mode it feeds streaming float64
accumulators (`qtransform.core.metrics.ErrorStats`) and keeps no tensor, so a scan over any number of
batches holds a constant amount of state per site; traced (torch.export, compile) it is one
`qtransform::tap` node labelled `<site>:<point>`, which exports turn into named outputs.

What each tap measures, comparing the value the model computes (the head) with the raw value the
site had before any pass (see `GraphSite`):

- weight: quantized weight against the original, once per weight version (`core.versions.Watch`:
  optimizer steps, merges and `.data` writes are seen as for the fake-quant cache; every byte is
  read at each forward under FSDP), not once per forward;
- input: quantized activation against the unquantized input (input quantization);
- output: quantized output against the raw output (output quantization) and, in shadow mode,
  the site's *local* error: its output against the full-precision result of the same site on the
  same input (`F.linear(raw input, raw weight, bias)`; `addmm` with the [in, out] weight for
  GPT-2's Conv1D). Sites no other pass touched are exact and skip the shadow product.

An attention site's taps sit on its query, key, value and probs ([batch, heads, tokens, head_dim]),
after their quantizers: the quantized tensor against the raw one, and the same per head
(`Tap.heads`: one scale per head or not, heads differ in range, and a KV format that suits most
heads can ruin one). Without attention points in the section, an attention site gets taps on
its query, key and value (never probs unless named: a probs tap makes the site compute its
attention eagerly).

A fused experts site's taps also get the tokens each expert received (its activations are grouped
by expert, `core/experts.py`): they keep each expert's token count and metrics beside the
site's (`Tap.experts`), so a report can say which expert loses what, and that an expert which
never saw a calibration token was not measured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.attention import PROBS
from qtransform.core.experts import COUNTS, grouped_linear
from qtransform.core.graph import POINTS
from qtransform.core.metrics import BlockExponentHistogram, ErrorStats
from qtransform.core.observers import collecting
from qtransform.core.phase import in_rollout
from qtransform.core.program import Program
from qtransform.core.sharding import sharded
from qtransform.core.sites import ATTENTION_KIND, LINEAR_KINDS
from qtransform.core.versions import Watch
from qtransform.formats import QuantConfig
from qtransform.passes.fake_quant import FakeQuantPass
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas import InstrumentSpec
from qtransform.schemas.base import ATTENTION_TENSORS


def sample_rows(t: Tensor, offset: int, stride: int) -> Tensor:
    """Every `stride`-th token row of an activation [..., features] from `offset` (stride 1:
    the tensor itself). Measuring a sample divides the cost of taps by about `stride`."""
    if stride == 1:
        return t
    return t.reshape(-1, t.shape[-1])[offset::stride]


def next_offset(seen: int, stride: int) -> int:
    """The first row of the next call to sample when `seen` rows came before: counting rows
    across calls keeps every `stride`-th token of the whole stream, whatever the batch shapes."""
    return -seen % stride


class Tap(nn.Module):
    """Identity on one site value that accumulates error metrics while enabled.

    Called as `tap(head, *extras)` by the graph: weight and input taps get the raw value; output
    taps get the raw output, raw input, raw weight and (when the site has one) the bias.
    Activations are measured on every `stride`-th token row of the stream the site sees (see
    `next_offset`); weights are always measured whole.
    """

    def __init__(self, site: str, point: str, *, site_kind: str, quantizer: QuantConfig | None,
                 shadow: bool = False, saturation: bool = True, block_exponents: bool = False,
                 transposed: bool = False):
        super().__init__()
        self.transposed = transposed  # experts stored [E, in, out]
        self.site = site
        self.point = point
        self.label = InstrumentPass.label(site, point)
        self.site_kind = site_kind
        self.quantizer = quantizer
        self.shadow = shadow and point == "output"
        self.saturation = saturation and quantizer is not None
        self.block_exponents = (block_exponents and point == "weight" and quantizer is not None
                                and quantizer.family.exponents is not None)
        self.per_head = site_kind == ATTENTION_KIND  # [batch, heads, tokens, head_dim]: per head too
        self.enabled = True
        self.stride = 1
        self.alternatives: nn.ModuleDict | None = None  # finer KV quantizers a scan measures too
        self.reset()

    def extra_repr(self) -> str:
        fmt = self.quantizer.name if self.quantizer else "unquantized"
        return f"{self.label!r}, {fmt}{', shadow' if self.shadow else ''}, enabled={self.enabled}"

    def reset(self) -> None:
        """Forget everything measured so far (a new scan starts from empty accumulators)."""
        self.stats = ErrorStats()
        self.local = ErrorStats() if self.shadow else None
        self.exponents = BlockExponentHistogram() if self.block_exponents else None
        self.calls = 0
        self.rows_seen = 0
        self._weight_watch = Watch()
        self.expert_stats: list[ErrorStats] | None = None  # experts sites: one per expert
        self.expert_tokens: list[int] | None = None
        self.head_stats: list[ErrorStats] | None = None  # attention sites: one per head
        self.alternative_stats = {label: ErrorStats() for label in self.alternatives or {}}

    def measure_alternatives(self, quantizers: dict[str, nn.Module]) -> None:
        """Also measure these quantizers (label -> module, labels without dots) on the tapped
        raw tensor, from empty accumulators (`alternative_stats`)."""
        self.alternatives = nn.ModuleDict(quantizers)
        self.alternative_stats = {label: ErrorStats() for label in quantizers}

    def train(self, mode: bool = True) -> Tap:
        self._weight_watch.recheck()  # a change of mode is a point where every byte is checked
        return super().train(mode)

    def forward(self, head: Tensor, *extras: Tensor) -> Tensor:
        if not self.enabled:
            return head
        if collecting():  # a calibration run is not measured; alternatives observe it
            for alternative in (self.alternatives or {}).values():
                alternative(head)
            return head
        if ops.is_tracing(head):
            return torch.ops.qtransform.tap(head, self.label)
        with torch.no_grad():
            if self.point == "weight":
                self._observe_weight(head, extras[0])
            elif self.site_kind == "experts":
                *operands, counts = extras
                self._observe(head, *operands, counts=counts)
                self._observe_experts(head, operands, counts)
            else:
                self._observe(head, *extras)
                if self.per_head:
                    self._observe_heads(head, extras[0])
        self.calls += 1
        return head

    # -- eager measurements -------------------------------------------------------------------
    def _saturated(self, raw: Tensor, sampled: Tensor, offset: int = 0) -> Tensor | None:
        """The format's clipped-at-max mask of the measured elements."""
        if not self.saturation:
            return None
        cfg = self.quantizer
        assert cfg is not None
        if cfg.stochastic:  # clipping does not depend on the rounding draw
            cfg = replace(cfg, rounding="rne", seed=None)
        if sampled is raw or (cfg.block_axis in (-1, raw.dim() - 1) and not cfg.tile):
            return formats.saturated(sampled, cfg)  # blocks lie within token rows
        return sample_rows(formats.saturated(raw, cfg), offset, self.stride)

    def _observe_weight(self, head: Tensor, raw: Tensor) -> None:
        if head is raw:
            return
        check = "content" if sharded(self) else "identity" if in_rollout() else "sample"
        if not self._weight_watch.changed(raw, check):
            return
        self.stats = ErrorStats().update(raw, head, self._saturated(raw, raw))  # this version only
        if self.site_kind == "experts":
            self.expert_stats = [ErrorStats().update(raw[e], head[e]) for e in range(raw.shape[0])]
        if self.exponents is not None:
            assert self.quantizer is not None
            self.exponents = BlockExponentHistogram().update(formats.block_exponents(raw, self.quantizer))

    def _observe(self, head: Tensor, raw: Tensor, *operands: Tensor, counts: Tensor | None = None) -> None:
        offset = next_offset(self.rows_seen, self.stride)
        self.rows_seen += head.numel() // head.shape[-1]
        rows = sample_rows(head, offset, self.stride)
        if head is not raw:  # something (fake-quant, noise) changed the value: measure it
            raw_rows = sample_rows(raw, offset, self.stride)
            self.stats.update(raw_rows, rows, self._saturated(raw, raw_rows, offset))
            for label, alternative in (self.alternatives or {}).items():
                other = sample_rows(alternative.quantized_copy(raw), offset, self.stride)
                self.alternative_stats[label].update(raw_rows, other)
        if self.local is not None:
            x, *params = operands
            if counts is not None:  # grouped rows: the reference needs them all, then samples
                self.local.update(sample_rows(self.reference(x, *params, counts=counts), offset,
                                              self.stride), rows)
            else:
                self.local.update(self.reference(sample_rows(x, offset, self.stride), *params), rows)

    def _observe_experts(self, head: Tensor, operands: list[Tensor], counts: Tensor) -> None:
        """Each expert's token count and metrics (every row: slices must stay whole)."""
        raw, *rest = operands
        n = counts.shape[0]
        if self.expert_stats is None or self.expert_tokens is None:
            self.expert_stats, self.expert_tokens = [ErrorStats() for _ in range(n)], [0] * n
        want = self.reference(rest[0], *rest[1:], counts=counts) if self.local is not None else raw
        if want is head:
            want = None  # nothing changed this value: tokens are counted, nothing to measure
        start = 0
        for e, k in enumerate(counts.tolist()):
            self.expert_tokens[e] += k
            if k and want is not None:
                self.expert_stats[e].update(want[start:start + k], head[start:start + k])
            start += k

    def _observe_heads(self, head: Tensor, raw: Tensor) -> None:
        """Each head's error, on every row (heads are few and their slices small)."""
        if head is raw:
            return
        if self.head_stats is None:
            self.head_stats = [ErrorStats() for _ in range(head.shape[1])]
        for h, stats in enumerate(self.head_stats):
            stats.update(raw[:, h], head[:, h])

    def reference(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                  counts: Tensor | None = None) -> Tensor:
        """The site's full-precision output on `x`, computed as the original module does
        (experts: each expert's token rows, `counts` per expert, times that expert's matrix)."""
        if counts is not None:
            ids = torch.repeat_interleave(torch.arange(counts.shape[0], device=x.device), counts)
            return grouped_linear(x, weight, ids, counts, self.transposed)
        if self.site_kind != "conv1d":
            return F.linear(x, weight, bias)
        rows = x.view(-1, x.size(-1))
        out = torch.mm(rows, weight) if bias is None else torch.addmm(bias, rows, weight)
        return out.view(*x.shape[:-1], weight.shape[-1])

    # -- results ------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """This tap's metrics: `quant` (head vs raw value), `local` (shadow), block exponents."""
        out: dict[str, Any] = {
            "site": self.site, "point": self.point, "label": self.label,
            "format": self.quantizer.name if self.quantizer else None, "calls": self.calls,
            "quant": self.stats.result() if self.stats.n else None,
        }
        if self.local is not None:
            out["local"] = self.local.result() if self.local.n else None
        if self.exponents is not None:
            out["block_exponents"] = self.exponents.result()
        if self.expert_stats is not None:
            out["experts"] = self.experts()
        if self.head_stats is not None:
            out["heads"] = self.heads()
        return out

    def heads(self) -> list[dict[str, Any]] | None:
        """Attention sites: per head, its metrics and raw sums (None before any measurement)."""
        if self.head_stats is None:
            return None
        return [{"head": h, "metrics": s.result() if s.n else None, "state": s.state() if s.n else None}
                for h, s in enumerate(self.head_stats)]

    def experts(self) -> list[dict[str, Any]] | None:
        """Experts sites: per expert, its calibration tokens (activations), metrics and raw sums
        (reports merge them per layer); None as metrics and sums where nothing was measured (an
        expert that never saw a token, say)."""
        if self.expert_stats is None:
            return None
        return [{"expert": e, **({"tokens": self.expert_tokens[e]} if self.expert_tokens else {}),
                 "metrics": s.result() if s.n else None, "state": s.state() if s.n else None}
                for e, s in enumerate(self.expert_stats)]


# -- model-level helpers ----------------------------------------------------------------------
def taps(model: nn.Module) -> list[Tap]:
    """Every tap in a transformed model, in module order."""
    return [m for m in model.modules() if isinstance(m, Tap)]


def reset_taps(model: nn.Module) -> None:
    """Empty every tap's accumulators (and forget which weight version was measured)."""
    for tap in taps(model):
        tap.reset()


def set_taps_enabled(model: nn.Module, enabled: bool) -> None:
    """Disabled taps are plain identities, eager and traced (no `qtransform::tap` node)."""
    for tap in taps(model):
        tap.enabled = enabled


@contextmanager
def tapping(model: nn.Module, enabled: bool = True, *, stride: int = 1) -> Iterator[list[Tap]]:
    """Enable (or disable) every tap for a block, measuring every `stride`-th token row of
    activations; each tap's flag and stride are restored afterwards."""
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    found = taps(model)
    before = [(t.enabled, t.stride) for t in found]
    for tap in found:
        tap.enabled, tap.stride = enabled, stride
    try:
        yield found
    finally:
        for tap, (flag, old) in zip(found, before, strict=True):
            tap.enabled, tap.stride = flag, old


# -- the pass ---------------------------------------------------------------------------------
@register_pass
class InstrumentPass(Pass[InstrumentSpec, InstrumentSpec]):
    """Taps on the points the policy's `instrument` section selects; no section, no taps."""

    name = "instrument"
    tag = "tap"
    requires = (FakeQuantPass.name,)
    section = "instrument"
    provides = ("instrument",)

    def select(self, program: Program, spec: InstrumentSpec) -> list[Action[InstrumentSpec]]:
        actions = []
        points = [p for p in POINTS if p in spec.points]
        for site in select_sites(program, spec, "instrument", kinds=(*LINEAR_KINDS, ATTENTION_KIND)):
            if site.kind == ATTENTION_KIND:
                actions += [Action(site, point, "instrument", spec, extra=(f"raw:{point}",))
                            for point in attention_points(spec)]
                continue
            experts = site.kind == "experts"  # biases are added inside; tokens per expert needed
            has_bias = not experts and getattr(program.model.get_submodule(site.name), "bias", None) is not None
            for point in points:
                extra: tuple[str, ...] = (f"raw:{point}",)
                if point == "output" and spec.shadow:
                    extra += ("raw:input", "raw:weight") + (("raw:bias",) if has_bias else ())
                if experts and point != "weight":
                    extra += (f"raw:{COUNTS}",)
                actions.append(Action(site, point, "instrument", spec, extra=extra))
        return actions

    def build(self, program: Program, action: Action[InstrumentSpec]) -> nn.Module:
        spec = action.payload
        site = action.site
        others = [i for i in program.insertions(site=site.name) if i.pass_name != self.name]
        return Tap(site.name, action.point, site_kind=site.kind,
                   quantizer=quantizer(program, site.name, action.point),
                   shadow=spec.shadow and bool(others),
                   saturation=spec.saturation, block_exponents=spec.block_exponents,
                   transposed=site.weight_transposed)

    @classmethod
    def label(cls, site: str, point: str) -> str:
        return f"{site}:{point}"

    def describe(self, action: Action[InstrumentSpec]) -> str:
        return "tap + shadow" if action.point == "output" and "raw:weight" in action.extra else "tap"


def attention_points(spec: InstrumentSpec) -> list[str]:
    """The points tapped on an attention site: the section's attention points, else query, key
    and value."""
    named = [p for p in ATTENTION_TENSORS if p in spec.points]
    return named or [p for p in ATTENTION_TENSORS if p != PROBS]


def quantizer(program: Program, site: str, point: str) -> QuantConfig | None:
    """The config of the fake-quant module on this point, read from the insertion log."""
    for ins in program.insertions(site=site, pass_name=FakeQuantPass.name):
        if ins.point == point:
            return program.module().get_submodule(ins.module_path).config
    return None
