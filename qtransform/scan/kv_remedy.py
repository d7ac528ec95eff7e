"""Finer KV-cache formats as the remedy for flagged key/value rows: measured, then chosen by cost.

A KV rule with one scale per tensor lets the widest head set the scale of every other: a head
whose keys are a thousand times larger crushes the rest to zero. The remedies are finer scales
in the same format, a ladder from the cheapest (only the rungs finer than the rule's own
granularity):

1. `head`: one static scale per KV head (granularity "head"), calibrated on the scan's batches
   as `transform` would calibrate the rewritten rule: with a static rule's own observer, else
   (dynamic or fixed scales) with llm-compressor's KV observer `minmax`. It costs no bit per
   element: the checkpoint stores [heads, 1, 1] k_scale / v_scale (compressed-tensors'
   `attn_head` strategy, what llm-compressor's KV_FP8_ATTN_HEAD writes).
2. `token`: one scale per token and KV head, computed as each token is written (dynamic). For
   FP8 and int8 rules it is vLLM's `fp8_per_token_head` / `int8_per_token_head` writer
   (`core/engines.py`, vLLM's Triton attention only, no checkpoint scale, an fp32 scale per
   token and head kept beside the cache); other formats take granularity "token".

Keeping the site's keys and values in 16 bits is the last resort: what `recommend` does when no
measured rung clears a row. An activation scan measures the rungs on the very tensors its
key/value taps see (`Tap.measure_alternatives`, same raw values, same sampled rows) into each
row's `remedies` (label -> {"metrics", "state", "rule", "fields", "engine", "rank"}: the index of
the KV rule, the rule fields the rung sets, the engine section it needs, its place on the
ladder). A rung clears a row when the report's own flagging rule (`ScanReport.row_problems`,
the thresholds `problems()` uses) finds nothing in the row measured with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qtransform.calibration.run import calibrate
from qtransform.core import engines
from qtransform.core.observers import StaticScale
from qtransform.passes.fake_quant import attention_quantizer
from qtransform.passes.instrument import taps
from qtransform.pipeline.selection import resolve_quantize
from qtransform.schemas import Policy, load_policy
from qtransform.schemas.sections.quantize import DEFAULT_OBSERVER

if TYPE_CHECKING:
    from qtransform.core.program import Program
    from qtransform.passes.instrument import Tap
    from qtransform.scan.report import ScanReport, SiteRow

KV_POINTS = ("key", "value")
KV_OBSERVER = "minmax"  # llm-compressor's KV-cache observer: per-head scales of a fixed-scale rule
SCALE_KEYS = ("granularity", "scale_source", "observer", "observer_kwargs", "fixed_scale", "global_scale")
WRITER_KEYS = ("fp8_variant", "int_range", "rounding", "scale_dtype", "seed")  # replaced by vLLM's


@dataclass(frozen=True)
class KVAlternative:
    """One rung of the ladder: what it sets on the KV rule and the engine section it needs."""

    granularity: str  # head | token
    label: str  # names the rung in reports (no dots: it keys the tap's quantizers)
    fields: dict[str, Any]
    engine: dict[str, Any] | None = None

    def rule(self, rule: dict[str, Any]) -> dict[str, Any]:
        return rewritten(rule, self.fields)


def rewritten(rule: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """`rule` (a quantize rule as JSON) with a rung's `fields` in place of its scales (and of its
    writer's conversion where the rung names a format), its selection kept."""
    drop = SCALE_KEYS + (WRITER_KEYS if "format" in fields else ())
    return {**{k: v for k, v in rule.items() if k not in drop}, **fields}


def ladder(rule: dict[str, Any]) -> list[KVAlternative]:
    """The rungs finer than a KV rule's own scales, cheapest first ([] for a rule already per
    token, or blocked along head_dim, whose scales a head cannot crush)."""
    quant = load_policy({"version": 1, "quantize": [rule]}).quantize[0]
    if not set(quant.tensors) & set(KV_POINTS) or quant.config().granularity != "tensor":
        return []
    rungs = [] if quant.granularity == "head" else [_per_head(rule, quant.scale_source)]
    return [*rungs, _per_token(rule["format"])]


def _per_head(rule: dict[str, Any], source: str) -> KVAlternative:
    """Static scales per head: the rule's observer, else llm-compressor's KV observer."""
    fmt = rule["format"]
    observer = rule.get("observer", DEFAULT_OBSERVER) if source == "static" else KV_OBSERVER
    kwargs = {"observer_kwargs": rule["observer_kwargs"]} if source == "static" and rule.get("observer_kwargs") else {}
    return KVAlternative("head", f"{fmt} per head, static {observer}",
                         {"granularity": "head", "scale_source": "static", "observer": observer, **kwargs})


def _per_token(fmt: str) -> KVAlternative:
    dtype = "fp8_per_token_head" if fmt.startswith("fp8") else "int8_per_token_head" if fmt == "int8" else None
    if dtype is None:
        return KVAlternative("token", f"{fmt} per token and head, dynamic",
                             {"granularity": "token", "scale_source": "dynamic"})
    fields = engines.per_token_head_fields(dtype, "triton")
    return KVAlternative("token", f"{fields['format']} per token and head (vLLM {dtype})", fields,
                         engines.engine_section("triton", dtype))


# -- measuring ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ladder:
    """The rungs a key/value tap measures and the index of the KV rule they rewrite."""

    rule: int
    rungs: list[KVAlternative]


def attach_alternatives(program: Program, policy: Policy, taps: Iterable[Tap]) -> dict[str, Ladder]:
    """Give each key/value tap of a KV rule the quantizers of its ladder (built as the pass
    builds the rewritten rule's, on the model's device); tap label -> its ladder."""
    rules = [r.model_dump(mode="json", exclude_defaults=True) for r in policy.quantize]
    index = {(a.site.name, a.point): next(i for i, r in enumerate(policy.quantize) if r is a.payload)
             for a in resolve_quantize(program, policy.quantize) if a.point in KV_POINTS}
    device = next((p.device for p in program.module().parameters()), torch.device("cpu"))
    given = {}
    for tap in taps:
        i = index.get((tap.site, tap.point))
        rungs = ladder(rules[i]) if i is not None else []
        if i is None or not rungs:
            continue
        site = program.sites[tap.site]
        tap.measure_alternatives({
            alt.label: attention_quantizer(site, tap.point, load_policy(
                {"version": 1, "quantize": [alt.rule(rules[i])]}).quantize[0]).to(device)
            for alt in rungs})
        given[tap.label] = Ladder(i, rungs)
    return given


def calibrate_alternatives(model: nn.Module, policy: Policy, batches: list[torch.Tensor]) -> None:
    """Calibrate the static scales of the alternatives as `transform` calibrates a rule's: the
    model's key/value scales, on the scan's batches, with the policy's calibration attention (the
    rule's own come out as they were: same batches, same full-precision forward). Nothing runs
    when no alternative has a static scale."""
    if not any(isinstance(m, StaticScale) for tap in taps(model) for m in (tap.alternatives or nn.ModuleDict()).modules()):
        return
    calibrate(model, batches, tensors=KV_POINTS,
              attention=policy.calibration.attention if policy.calibration is not None else "model")


def remedies(tap: Tap, kv: Ladder) -> dict[str, dict[str, Any]] | None:
    """A key/value tap's measured rungs as its row's `remedies` (None: nothing measured)."""
    out = {}
    for rank, alt in enumerate(kv.rungs):
        stats = tap.alternative_stats.get(alt.label)
        if stats is not None and stats.n:
            out[alt.label] = {"metrics": stats.result(), "state": stats.state(), "rule": kv.rule,
                              "fields": alt.fields, "engine": alt.engine, "rank": rank}
    return out or None


# -- choosing ----------------------------------------------------------------------------------
def is_kv_row(row: SiteRow) -> bool:
    """A quantized key or value row of an attention site."""
    return row.kind == "attention" and row.point in KV_POINTS and row.format != "none"


def remedied_row(row: SiteRow, label: str) -> SiteRow:
    """The row as it reads measured with the rung `label`."""
    entry = (row.remedies or {})[label]
    return replace(row, metrics=dict(entry["metrics"]), state=dict(entry["state"]), heads=None,
                   remedies=None, diagnostics=None)


def clears(report: ScanReport, row: SiteRow, label: str) -> bool:
    """Whether the report's own flagging rule finds nothing in `row` measured with `label` (the
    other rows as they are: a robust outlier is judged among the same peers)."""
    trial = remedied_row(row, label)
    judged = replace(report, rows=[trial if r is row else r for r in report.rows], _cache=None)
    return not judged.row_problems(trial)


@dataclass
class KVChoice:
    """For one KV rule: the rung that clears its flagged rows (None: none measured clears one),
    those rows ("site [point]") with their SQNR before and after, and the sites no rung clears."""

    rule: int
    label: str | None
    fields: dict[str, Any]
    engine: dict[str, Any] | None
    cleared: list[tuple[str, float, float]] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def kv_choices(report: ScanReport) -> tuple[list[KVChoice], list[str]]:
    """Per KV rule with flagged rows, the cheapest rung that clears every flagged row any rung
    clears (`clears`); and the sites of flagged KV rows without measured rungs (kept out of
    their KV rule, as before the scans measured any)."""
    flagged = [row for row, _ in report.problems() if is_kv_row(row)]
    by_rule: dict[int, list[SiteRow]] = {}
    bare = []
    for row in flagged:
        entries = row.remedies or {}
        if not entries:
            bare.append(row.site)
            continue
        by_rule.setdefault(next(iter(entries.values()))["rule"], []).append(row)
    choices = []
    for rule, rows in by_rule.items():
        labels = sorted({k for r in rows for k in r.remedies or {}},
                        key=lambda k: next(r.remedies[k]["rank"] for r in rows if k in (r.remedies or {})))
        cleared = {label: [r for r in rows if label in (r.remedies or {}) and clears(report, r, label)]
                   for label in labels}
        best = max((len(c) for c in cleared.values()), default=0)
        label = next((k for k in labels if len(cleared[k]) == best), None) if best else None
        entry = next((r.remedies[label] for r in rows if label in (r.remedies or {})), None) if label else None
        done = cleared[label] if label else []
        choices.append(KVChoice(
            rule, label, dict(entry["fields"]) if entry else {}, entry.get("engine") if entry else None,
            [(r.label, r.metrics["sqnr_db"], r.remedies[label]["metrics"]["sqnr_db"]) for r in done],
            list(dict.fromkeys(r.site for r in rows if r not in done))))
    return choices, list(dict.fromkeys(bare))


def cost_text(label: str, fields: dict[str, Any], engine: dict[str, Any] | None) -> str:
    """What a rung costs and which engines run it, in words."""
    if fields.get("granularity") == "head":
        return (f"{label}: no extra bit per element, one static scale per KV head and layer, stored "
                "in the checkpoint as llm-compressor's attn_head strategy (k_scale / v_scale "
                "[heads, 1, 1], `export_checkpoint`); transformers with compressed-tensors runs "
                "it; whether an engine reads per-head scales was not checked here")
    if engine is not None:
        return (f"{label}: dynamic, one fp32 scale per token and KV head computed as each token is "
                f"written (32 bits per head_dim elements beside the cache), no checkpoint scale; "
                f"vLLM's Triton attention only (kv_cache_dtype {engine['kv_cache_dtype']})")
    return (f"{label}: dynamic, one scale per token and KV head, no checkpoint scale; no engine "
            "here computes it for this format")
