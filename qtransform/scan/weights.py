"""Weight scans: how much each Linear-like weight of a model loses under a format.

A weight scan needs no data and no forward pass: each 2-D weight is fake-quantized once and
compared with itself, tensor by tensor, so a checkpoint far larger than memory can be scanned
(peak memory is set by the largest tensor). `compare_formats` runs several formats over the same
tensors and adds their errors up across the model.

What is scanned: the weight of every Linear-like site of `qtransform.core.sites` (`nn.Linear`,
GPT-2 `Conv1D`, fused expert parameters; lm_head included and marked by its role; MoE routers
only when a policy names them, as the class selector `Linear` does): the very site table that
plans and transforms use. A fused experts weight [E, ...] is quantized
expert by expert, as each matrix would be in an nn.Linear; its row sums all experts and lists
each expert's metrics (`SiteRow.experts`). Where the tensors come from (a module, a safetensors
checkpoint): `scan/sources.py`; what a policy's quantizers make of them (W·R, a scale group's
amax): `scan/seen.py`. Blocks run along the reduction axis (axis 0 for Conv1D, which stores
[in, out]).

The activation scan (qtransform.scan.activations) feeds the same `ErrorStats` accumulators and
builds the same `ScanReport` from rows with point "input"/"output".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qtransform import formats
from qtransform.core.metrics import BlockExponentHistogram, ErrorStats
from qtransform.core.progress import Progress
from qtransform.core.sites import Site
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.formats.options import CHOICE_OPTIONS, FORMAT_KEYS
from qtransform.formats.quantize import four_over_six_blocks, quantize_with_info
from qtransform.passes.fake_quant import first_weight_seed
from qtransform.scan import fos_remedy
from qtransform.scan.compare import Comparison
from qtransform.scan.grid import grid_fit
from qtransform.scan.problems import DEFAULT_THRESHOLDS, check_flagging
from qtransform.scan.remedy import Rotation
from qtransform.scan.report import ScanReport, SiteRow, build_meta
from qtransform.scan.seen import SeenWeights, scale_groups
from qtransform.scan.sources import WeightRef, source_label, weight_refs
from qtransform.schemas import Selector, load_policy, resolve_quant_rules

if TYPE_CHECKING:
    from qtransform.schemas import PolicyLike

DEFAULT_TARGET = "Linear"  # what a scan without a policy measures: every linear site but the routers


# -- formats and options ----------------------------------------------------------------------
def config_for(fmt: str, options: dict[str, Any] | None) -> QuantConfig:
    """Validate `fmt` and options once (unknown names become UserErrors with a suggestion)."""
    try:
        cfg = QuantConfig.from_options(fmt, options)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return _named_stream(cfg)


def format_spec(text: str) -> tuple[str, dict[str, Any]]:
    """'nvfp4:four_over_six=mse:global_bound=256' -> ('nvfp4', {...}): a format with its own
    options (`compare --formats nvfp4,nvfp4:four_over_six=mse`); numbers become ints."""
    name, *pairs = text.strip().split(":")
    own: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise UserError(f"format {text!r}: write FORMAT:OPTION=VALUE[:OPTION=VALUE...], e.g. "
                            "nvfp4:four_over_six=mse")
        value = value.strip()
        own[key.strip()] = int(value) if value.isdigit() and key.strip() in ("block_size", "seed") else value
    return name.strip(), own


def _named_stream(cfg: QuantConfig) -> QuantConfig:
    """Stochastic rounding without a seed uses seed 0, so a report always names its stream."""
    return replace(cfg, seed=0) if cfg.stochastic and cfg.seed is None else cfg


def applicable_options(fmt: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The subset of shared options a format takes (compare runs MX and NVFP4 side by side)."""
    spec = formats.get(fmt)
    return {
        k: v for k, v in (options or {}).items()
        if k not in CHOICE_OPTIONS or k in spec.options
    }


def policy_configs(policy: PolicyLike, sites: Sequence[Site]) -> dict[str, QuantConfig]:
    """Site name -> the config of the quantize rule that applies to its weight (the training
    option zero_saturated_grad dropped: it changes no value)."""
    per_rule: dict[int, QuantConfig] = {}
    out = {}
    for (name, tensor), (index, rule) in resolve_quant_rules(load_policy(policy).quantize, sites).items():
        if tensor != "weight":
            continue
        if index not in per_rule:
            cfg = replace(rule.config(), zero_saturated_grad=False)
            per_rule[index] = _named_stream(cfg)
        out[name] = per_rule[index]
    return out


def policy_rule_index(policy: PolicyLike | None, sites: Sequence[Site]) -> dict[str, int]:
    """Site name -> the index of the quantize rule that applies to its weight (0 for every site
    without a policy: the scan's one rule); remedies name the rule they would change."""
    if policy is None:
        return {s.name: 0 for s in sites}
    found = resolve_quant_rules(load_policy(policy).quantize, sites).items()
    return {name: index for (name, tensor), (index, _) in found if tensor == "weight"}


def policy_thresholds(policy: PolicyLike) -> dict[str, float]:
    pol = load_policy(policy)
    if pol.instrument is None:
        return dict(DEFAULT_THRESHOLDS)
    return dict(pol.instrument.thresholds.model_dump())


def policy_rules(policy: PolicyLike) -> list[dict[str, Any]]:
    """The policy's quantize rules as JSON dicts (recommendations edit copies of them)."""
    return [r.model_dump(mode="json", exclude_defaults=True) for r in load_policy(policy).quantize]


def rotate_rules(policy: PolicyLike) -> list[dict[str, Any]]:
    """The policy's rotate rules as JSON dicts (a report records what its weights were rotated by)."""
    return [r.model_dump(mode="json", exclude_defaults=True) for r in load_policy(policy).rotate]


# -- measuring one tensor ---------------------------------------------------------------------
def measure(
    w: torch.Tensor, site: Site, cfg: QuantConfig, expert: int | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[ErrorStats, BlockExponentHistogram | None, dict[str, float] | None]:
    """Fake-quantize one weight and accumulate its error, saturation, MX block exponents and the
    channel diagnostics that problem reasons quote (`channel_diagnostics`; 1-D blocks only).

    One quantization gives all three (`quantize_with_info`); the metrics are one more pass. A
    fused experts weight is measured expert by expert and merged (`measure_experts`). Stochastic
    rounding draws what the transformed model's first forward draws for this weight
    (`passes.fake_quant.first_weight_seed`), so the scan measures that very tensor. `amax` is a
    shared tensor-level amax (`SeenWeights.amax`; one per expert for a fused experts weight).
    """
    if site.kind == "experts":
        stats, hist, _ = measure_experts(w, site, cfg, amax)
        return stats, hist, None
    cfg = cfg.bind(site.reduction_axis)
    seed = first_weight_seed(cfg, site.name, expert)
    xq, sat, exps = quantize_with_info(w, cfg, exponents=cfg.family.exponents is not None, seed=seed,
                                       amax=amax)
    stats = ErrorStats().update(w, xq, sat)
    hist = BlockExponentHistogram().update(exps) if exps is not None else None
    diagnostics = None
    if not cfg.tile and w.ndim == 2:
        diagnostics = channel_diagnostics(w, xq, cfg.block_axis, cfg.block)
    return stats, hist, diagnostics


OUTLIER_CHANNEL_RATIO = 8.0  # an input channel whose typical |w| is 8x the typical channel's


def channel_diagnostics(w: torch.Tensor, xq: torch.Tensor, axis: int, block: int | None) -> dict[str, float]:
    """Why a weight may quantize badly, in numbers a reason can quote: input channels (positions
    along the reduction axis) whose median |w| is `OUTLIER_CHANNEL_RATIO` times the median over
    channels (medians, so a few heavy-tailed values do not make a channel), and the share of the *other* nonzero values in blocks holding such a channel that
    quantize to zero (the outlier sets the block scale and crushes its neighbours)."""
    x = w.detach().double().movedim(axis, -1).reshape(-1, w.shape[axis])
    q = xq.detach().double().movedim(axis, -1).reshape(-1, w.shape[axis])
    peak = torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0).median(dim=0).values
    median = float(peak.median())
    outliers = peak > OUTLIER_CHANNEL_RATIO * median if median > 0 else torch.zeros_like(peak, dtype=torch.bool)
    out = {"outlier_channels": float(outliers.sum()), "outlier_block_deadzone": math.nan}
    if not outliers.any() or block is None:
        return out
    blocks = torch.arange(x.shape[1]) // block
    hit = torch.isin(blocks, blocks[outliers]) & ~outliers  # neighbours sharing a block scale
    nonzero = (x[:, hit] != 0)
    if nonzero.any():
        out["outlier_block_deadzone"] = float(((q[:, hit] == 0) & nonzero).sum() / nonzero.sum())
    return out


def measure_experts(
    w: torch.Tensor, site: Site, cfg: QuantConfig, amax: torch.Tensor | None = None
) -> tuple[ErrorStats, BlockExponentHistogram | None, list[ErrorStats]]:
    """Each expert's matrix of a fused [E, ...] weight measured as an nn.Linear weight; (all
    experts merged, their block exponents, each expert's stats)."""
    two_d = Site(site.name, site.cls_name, "linear", site.layer, site.role,
                 weight_shape=tuple(w.shape[1:]), weight_transposed=site.weight_transposed)
    per_expert = [measure(w[e], two_d, cfg, expert=e, amax=None if amax is None else amax[e])
                  for e in range(w.shape[0])]
    total = ErrorStats()
    hist = None
    for stats, h, _ in per_expert:
        total.merge(stats)
        if h is not None:
            hist = h if hist is None else hist.merge(h)
    return total, hist, [stats for stats, _, _ in per_expert]


def max4_counts(w: torch.Tensor, site: Site, cfg: QuantConfig, amax: torch.Tensor | None = None,
                expert: int | None = None) -> tuple[int, int]:
    """(blocks that kept the max/4 scale, blocks) of a weight under a four-over-six config: the
    quantizer's own choice (`four_over_six_blocks`) with the seed and shared amax `measure` uses;
    a fused experts weight expert by expert."""
    if site.kind == "experts":
        two_d = Site(site.name, site.cls_name, "linear", site.layer, site.role,
                     weight_shape=tuple(w.shape[1:]), weight_transposed=site.weight_transposed)
        counts = [max4_counts(w[e], two_d, cfg, None if amax is None else amax[e], e)
                  for e in range(w.shape[0])]
        return sum(c for c, _ in counts), sum(b for _, b in counts)
    cfg = cfg.bind(site.reduction_axis)
    mask = four_over_six_blocks(w, cfg, seed=first_weight_seed(cfg, site.name, expert), amax=amax)
    return int(mask.sum()), mask.numel()


def _progress(refs: Sequence[WeightRef], progress: bool | None, desc: str) -> Progress:
    """Progress in parameters (`core.progress`: a bar on a terminal, lines elsewhere)."""
    total = sum(math.prod(r.site.weight_shape or ()) for r in refs)
    return Progress(total=total, desc=desc, unit="param", unit_scale=True, enabled=progress)


def _select(refs: list[WeightRef], policy: PolicyLike | None) -> list[tuple[WeightRef, QuantConfig | None]]:
    """(weight, choice) pairs; with a policy only the sites its rules select, with their choice;
    without one, those of the rule `_rules` records (`Linear`: MoE routers only when named)."""
    if not refs:
        raise UserError("no Linear-like 2-D weights found to scan")
    if policy is None:
        every = Selector.compile([DEFAULT_TARGET])
        return [(r, None) for r in refs if every.matches(r.site)]
    chosen = policy_configs(policy, [r.site for r in refs])
    pairs = [(r, chosen[r.site.name]) for r in refs if r.site.name in chosen]
    if not pairs:
        raise UserError("the policy's quantize rules select none of the scanned weights")
    return pairs


def _row(ref: WeightRef, cfg: QuantConfig, stats: ErrorStats, hist: BlockExponentHistogram | None,
         experts: list[ErrorStats] | None = None, diagnostics: dict[str, float] | None = None) -> SiteRow:
    site = ref.site
    row = SiteRow.from_stats(
        site.name, "weight", stats, layer=site.layer, role=site.role, kind=site.kind,
        shape=list(site.weight_shape or ()), fmt=cfg.name, options=cfg.options(),
        block_exponents=hist.result() if hist is not None else None,
    )
    if experts is not None:
        row.experts = [{"expert": e, "metrics": s.result(), "state": s.state()} for e, s in enumerate(experts)]
    row.diagnostics = diagnostics
    return row


def _measured_row(ref: WeightRef, w: torch.Tensor, cfg: QuantConfig,
                  amax: torch.Tensor | None = None) -> tuple[SiteRow, ErrorStats]:
    """The row of one weight (with per-expert entries for a fused experts weight) and its stats."""
    if ref.site.kind == "experts":
        stats, hist, experts = measure_experts(w, ref.site, cfg, amax)
        row = _row(ref, cfg, stats, hist, experts)
    else:
        stats, hist, diagnostics = measure(w, ref.site, cfg, amax=amax)
        row = _row(ref, cfg, stats, hist, diagnostics=diagnostics)
    if cfg.name == "nvfp4" and cfg.four_over_six != "none":  # which blocks kept max/4
        chosen, blocks = max4_counts(w, ref.site, cfg, amax)
        row.diagnostics = {**(row.diagnostics or {}), "max4_blocks": float(chosen),
                           "blocks": float(blocks), "max4_share": chosen / blocks if blocks else 0.0}
    return row, stats


def _fos_remedies(ref: WeightRef, w: torch.Tensor, cfg: QuantConfig, amax: torch.Tensor | None,
                  modes: Sequence[str], rule: int) -> dict[str, dict[str, Any]]:
    """Four over six measured on a plain NVFP4 weight, one entry per mode (scan/fos_remedy.py;
    {} where the config does not take it)."""
    out = {}
    for mode in modes:
        alt = fos_remedy.alternative(cfg, mode)
        if alt is None:
            continue
        row, stats = _measured_row(ref, w, alt, amax)
        assert row.diagnostics is not None
        out[fos_remedy.label(mode)] = fos_remedy.entry(
            stats, mode, rule, (int(row.diagnostics["max4_blocks"]), int(row.diagnostics["blocks"])))
    return out


def _rotated_row(ref: WeightRef, w: torch.Tensor, cfg: QuantConfig,
                 rotation: Rotation) -> tuple[SiteRow, ErrorStats] | None:
    """The row of the rotated weight W·R (scan/remedy.py: its SQNR and MSE are W's under the
    rotation); None where the rotation does not fit the site's reduction axis."""
    rotated = rotation.apply(w.detach(), ref.site.reduction_axis)
    return None if rotated is None else _measured_row(ref, rotated, cfg)


def _rotation(rotation: str | Rotation | None) -> Rotation | None:
    return Rotation.parse(rotation) if isinstance(rotation, str) else rotation


# -- public API -------------------------------------------------------------------------------
def scan_weights(
    source: nn.Module | str | os.PathLike[str],
    fmt: str | None = None,
    *,
    policy: PolicyLike | None = None,
    options: dict[str, Any] | None = None,
    thresholds: dict[str, float] | None = None,
    flagging: str = "expected",
    progress: bool | None = False,
    rotation: str | Rotation | None = None,
    four_over_six: Sequence[str] = fos_remedy.MODES,
) -> ScanReport:
    """Scan every Linear-like weight of `source` under `fmt` (with `fake_quantize` `options`).

    With a `policy` (Policy, dict or path): its quantize rules select the sites and, when `fmt` is
    None, give each site its format and options; a site its `rotate` rules select is measured
    rotated (W·R, what the transformed model quantizes); its `instrument.thresholds` flag problems
    (`thresholds` overrides both). `flagging`: "expected" flags sites worse than the format does
    on Gaussian data of their block structure or outliers among the model's sites; "absolute"
    applies the fixed thresholds (docs/metrics.md). `rotation` (e.g. "hadamard-32", see
    `scan.remedy.Rotation`) also measures every weight rotated along its reduction axis, into
    each row's `remedies`, where `recommend` weighs it against higher precision. `four_over_six`:
    the modes ("mse", "mae") measured on every plain NVFP4 weight (scan/fos_remedy.py), into the
    same `remedies` with the share of blocks that keep max/4; () measures none.
    """
    if fmt is None and policy is None:
        raise UserError("give a format (e.g. mxfp4) or a policy with quantize rules")
    bad = [m for m in four_over_six if m not in ("mse", "mae")]
    if bad or isinstance(four_over_six, str):
        raise UserError(f"four_over_six {four_over_six!r}: give a list of modes, 'mse' and/or 'mae' "
                        "(an empty list measures none)")
    default = config_for(fmt, options) if fmt is not None else None
    rot = _rotation(rotation)
    pairs = _select(weight_refs(source), policy)
    rotate = rotate_rules(policy) if policy is not None else []
    groups = scale_groups(policy, [r.site for r, _ in pairs]) if default is None else []
    seen = SeenWeights.of([r for r, _ in pairs], rotate, groups)
    index = policy_rule_index(policy, [r.site for r, _ in pairs])
    rows = []
    grids = {}
    with _progress([r for r, _ in pairs], progress, f"scan {fmt or 'policy'}") as bar:
        for ref, by_policy in pairs:
            cfg = default or by_policy
            assert cfg is not None
            name = ref.site.name
            w = ref.load()
            if (fit := grid_fit(w)) is not None:  # the stored weight, before any rotation
                grids[name] = fit.to_dict()
            w = seen.tensor(name, w)  # W·R where the policy rotates it: what is quantized
            row = _measured_row(ref, w, cfg, seen.amax(name))[0]
            rotated = _rotated_row(ref, w, cfg, rot) if rot is not None else None
            if rot is not None and rotated is not None:
                row.remedies = {rot.label: {"metrics": rotated[1].result(), "state": rotated[1].state()}}
            if fos := _fos_remedies(ref, w, cfg, seen.amax(name), four_over_six, index.get(name, 0)):
                row.remedies = {**(row.remedies or {}), **fos}
            rows.append(row)
            bar.update(w.numel())
            del w
    fmts = sorted({row.format for row in rows})
    meta = build_meta(
        kind="weight_scan", source=source_label(source), fmt=fmts[0] if len(fmts) == 1 else "mixed",
        options=default.options() if default else {}, quantize=_rules(policy, default), grids=grids,
        **({"rotate": rotate} if rotate else {}), **({"scale_groups": groups} if groups else {}),
        **({"rotation": rot.label} if rot is not None else {}),
    )
    return ScanReport(meta=meta, rows=rows, thresholds=_limits(policy, thresholds),
                      flagging=check_flagging(flagging))


def _limits(policy: PolicyLike | None, thresholds: dict[str, float] | None) -> dict[str, float]:
    limits = dict(policy_thresholds(policy) if policy is not None else DEFAULT_THRESHOLDS)
    limits.update(thresholds or {})
    return limits


def _rules(policy: PolicyLike | None, cfg: QuantConfig | None) -> list[dict[str, Any]]:
    """The quantize rules the scan measured: the policy's (with the scanned format, if one was
    given) or one rule for every Linear; recommendations start from them."""
    rules = policy_rules(policy) if policy is not None else [{"name": "weights", "targets": [DEFAULT_TARGET]}]
    if cfg is None:
        return rules
    fields = {"format": cfg.name, **cfg.options()}
    return [{**{k: v for k, v in r.items() if k not in (*FORMAT_KEYS, "format")}, **fields}
            for r in rules]


def weight_grids(source: nn.Module | str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Every Linear-like weight of `source` already on a coarse grid (`scan.grid`): site -> fit."""
    fits = {}
    for ref in weight_refs(source):
        if (fit := grid_fit(ref.load())) is not None:
            fits[ref.site.name] = fit.to_dict()
    return fits


def compare_formats(
    source: nn.Module | str | os.PathLike[str],
    formats_: Sequence[str],
    *,
    policy: PolicyLike | None = None,
    options: dict[str, Any] | None = None,
    progress: bool | None = False,
    rotation: str | Rotation | None = None,
) -> Comparison:
    """Quantize the same weights with each format; totals sum the accumulators over all tensors.

    Per-layer dB values are never averaged: a model-wide SQNR is the signal energy of all weights
    over their total error energy. Shared `options` go to the formats that take them; a format
    may carry its own (`format_spec`: "nvfp4:four_over_six=mse" beside "nvfp4"), and a
    four-over-six column's totals add `max4_share`, the share of blocks that kept max/4. Each tensor
    is read once for all formats. `rotation` (e.g. "hadamard-32") adds, beside each format, the
    column "FORMAT with ROTATION": the same format on the weights rotated along their reduction
    axis (scan/remedy.py); a site the rotation does not fit counts unrotated there (a note
    says how many).
    """
    if len(formats_) < 1:
        raise UserError("give at least one format to compare")
    choices = {}
    for text in formats_:
        fmt, own = format_spec(text)
        cfg = config_for(fmt, {**applicable_options(fmt, options), **own})
        choices[text.strip() if own else cfg.name] = cfg
    rot = _rotation(rotation)
    columns = {f: (f, None) for f in choices}
    if rot is not None:
        columns = {k: v for f in choices for k, v in ((f, (f, None)), (f"{f} with {rot.label}", (f, rot)))}
    pairs = _select(weight_refs(source), policy)
    rows: dict[str, list[SiteRow]] = {c: [] for c in columns}
    totals = {c: ErrorStats() for c in columns}
    unfit = set()
    with _progress([r for r, _ in pairs], progress, "compare") as bar:
        for ref, _ in pairs:
            w = ref.load()
            for column, (f, how) in columns.items():
                measured = _rotated_row(ref, w, choices[f], how) if how is not None else None
                if how is not None and measured is None:
                    unfit.add(ref.site.name)
                row, stats = measured or _measured_row(ref, w, choices[f])
                totals[column].merge(stats)
                rows[column].append(row)
            bar.update(w.numel())
            del w
    limits = _limits(policy, None)
    reports = {
        column: ScanReport(
            meta=build_meta(kind="weight_scan", source=source_label(source), fmt=choices[f].name,
                            options=choices[f].options(), quantize=_rules(policy, choices[f]),
                            **({"rotation": how.label} if how is not None else {})),
            rows=rows[column], thresholds=limits,
        )
        for column, (f, how) in columns.items()
    }
    results = {c: t.result() for c, t in totals.items()}
    for column, report in reports.items():
        counted = [r.diagnostics for r in report.rows if r.diagnostics and "max4_blocks" in r.diagnostics]
        if counted:  # a four-over-six column: the blocks that kept max/4, over all its weights
            results[column]["max4_share"] = (sum(d["max4_blocks"] for d in counted)
                                             / max(1.0, sum(d["blocks"] for d in counted)))
    comparison = Comparison.of(results, reports)
    if unfit and rot is not None:
        comparison.notes.append(
            f"{rot.label} does not fit the reduction axis of {len(unfit)} of {len(pairs)} sites "
            f"(not a multiple of its block, or not a power of two): those count unrotated in the "
            f"'with {rot.label}' columns.")
    return comparison
