"""From a scan report to an action: which layers to keep in high precision, where AQN goes.

The rule reads the share of problematic decoder layers (a layer is as bad as its worst site):

- under 10 %: keep those layers in high precision, quantize the rest;
- 10-30 %: keep the worst (by layer SQNR, at most `keep_fraction` of the layers) in high
  precision and train the rest with SRDD-guided AQN: sigma multipliers by SQNR tier;
- over 30 %: the format is too coarse for this model: try a finer one (e.g. MXFP8).

A weight scan of plain NVFP4 measures four over six on every weight (scan/fos_remedy.py): it
costs no storage bit and nothing at inference, so it comes first: the rules of the flagged sites
it clears gain `four_over_six`, and the report is judged with it on their weights.
A report that measured a rotation (`scan_weights(rotation=...)`, scan/remedy.py) then rotates
the flagged sites the rotation heals (its cost model: an online transform of the activations
against the bits of higher precision), then applies the rule above to what is still flagged.

Attention key/value rows are judged apart (`with_kv_cache`): they never make a layer problematic;
a flagged one gets the cheapest finer KV scales the activation scan measured that clear it
(scan/kv_remedy.py: per head, then per token and head), the KV rule rewritten to them, or,
when none clears, its site kept out of the KV rule (its keys and values in 16 bits).

Every recommendation carries a policy dict that does it, validated by `qtransform.schemas`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from qtransform import formats
from qtransform.errors import UserError
from qtransform.formats.expected import effective_bits
from qtransform.formats.options import FORMAT_KEYS
from qtransform.scan import fos_remedy
from qtransform.scan.kv_remedy import KVChoice, cost_text, is_kv_row, kv_choices, rewritten
from qtransform.scan.remedy import Rotation, healed_sites
from qtransform.schemas import load_policy
from qtransform.schemas.base import ATTENTION_TENSORS
from qtransform.schemas.selectors import format_layers

if TYPE_CHECKING:
    from qtransform.scan.report import ScanReport
    from qtransform.scan.sensitivity_report import SensitivityReport

DEFAULT_TIERS = (1.5, 1.2, 1.0)
AQN_SCHEDULE = {"kind": "exponential", "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10}
KEEP_BELOW, CHANGE_ABOVE = 0.10, 0.30
SHOWN_DISAGREEMENTS = 6  # sites named per kind of disagreement; the rest are counted
HIGH_PRECISION_BITS = 16.0  # a site kept out of quantization stays in bf16/fp16


@dataclass
class Recommendation:
    """What to do about a scan, why, and the policy that does it."""

    # four_over_six | rotate | kv_cache | keep_high_precision | high_precision_and_aqn | change_format
    kind: str
    share: float  # problematic layers / layers (sites / sites when no row has a layer)
    problematic_layers: list[int]
    kept_layers: list[int]
    kept_sites: list[str]
    text: str
    policy: dict[str, Any]
    ranking: str | None = None  # the sensitivity measure the kept sites follow (None: weight error)
    disagreements: list[str] = field(default_factory=list)  # where the two views differ, in words
    rotated_sites: list[str] = field(default_factory=list)  # healed by the measured rotation
    # per KV rule with flagged key/value rows: {"rule", "alternative" (None: none clears),
    # "rows" (cleared, "site [point]"), "kept" (sites out of the KV rule)}
    kv_cache: list[dict[str, Any]] = field(default_factory=list)
    # the four-over-six mode a weight scan measured that clears flagged sites: {"alternative",
    # "mode", "rules" (indices that gain it), "rows" (cleared sites), "max4_share" (site -> share
    # of blocks that keep max/4)}; None when none clears one
    four_over_six: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def layer_tiers(layer_sqnr: dict[int, float], tiers: Sequence[float] = DEFAULT_TIERS) -> dict[int, float]:
    """Sigma multiplier per layer: layers ranked by SQNR split into len(tiers) equal groups,
    the worst group gets tiers[0] (ties keep layer order; NaN SQNR ranks as best)."""
    if not tiers or any(not (isinstance(t, int | float) and t > 0) for t in tiers):
        raise UserError(f"tiers must be positive multipliers, got {list(tiers)!r}")
    order = sorted(layer_sqnr, key=lambda k: (_nan_last(layer_sqnr[k]), k))
    n = len(order)
    return {layer: float(tiers[rank * len(tiers) // n]) for rank, layer in enumerate(order)}


def aqn_section(
    layer_sqnr: dict[int, float], tiers: Sequence[float] = DEFAULT_TIERS, *, total_steps: int = 1000,
    layers: Sequence[int] | None = None,
) -> dict[str, Any]:
    """SRDD-guided AQN: QeRL's exponential schedule (1e-2 to 1e-4, 10 stages) on the norms, with
    larger sigma where the scan found larger error. `total_steps` is the training run's length."""
    section: dict[str, Any] = {
        "targets": ["RMSNorm", "LayerNorm"],
        "schedule": {**AQN_SCHEDULE, "total_steps": int(total_steps)},
        "layer_multipliers": {str(k): v for k, v in sorted(layer_tiers(layer_sqnr, tiers).items())},
        "seed": 0,
    }
    if layers is not None:
        section["layers"] = format_layers(layers)
    return section


def finer_format(fmt: str) -> str | None:
    """A format with more element bits to suggest when too many layers fail (None: none finer)."""
    return {"mxfp8_e4m3": "mxint8", "mxint8": None, "int8": None}.get(fmt, "mxfp8_e4m3")


def _rules(report: ScanReport) -> list[dict[str, Any]]:
    """Copies of the quantize rules the report measured (meta.quantize), else one rule for its format."""
    rules = report.meta.get("quantize")
    if rules:
        return [dict(r) for r in rules]
    fmt = report.meta.get("format")
    if fmt not in formats.names():
        raise UserError(f"the report names no quantize rules and no single format (format {fmt!r}): "
                        "re-run `qtransform scan`")
    return [{"name": "weights", "targets": ["Linear"], "format": fmt, "tensors": ["weight"]}]


def ignoring(rules: list[dict[str, Any]], sites: Sequence[str],
             attention: Collection[str] = ()) -> list[dict[str, Any]]:
    """The rules with `sites` kept out of quantization: each rule ignores the kept sites of its
    own kind (an attention rule the `attention` sites among them, a Linear rule the others), as
    an ignore entry that matches no site of its rule's kind is an error."""
    for rule in rules:
        own = _attention_rule(rule)
        mine = [s for s in sites if (s in attention) == own]
        if mine:
            rule["ignore"] = list(dict.fromkeys([*rule.get("ignore", []), *mine]))
    return rules


def _attention_rule(rule: dict[str, Any]) -> bool:
    """A rule on an attention's tensors (its keys, values, query, probabilities)."""
    return any(t in ATTENTION_TENSORS for t in rule.get("tensors", ["weight"]))


def attention_sites(report: ScanReport) -> set[str]:
    """The report's attention sites (their keys, values, queries and probabilities)."""
    return {row.site for row in report.rows if row.kind == "attention"}


def validated(policy: dict[str, Any]) -> dict[str, Any]:
    load_policy(policy)  # a PolicyError here is a bug in this module, not a user mistake
    return policy


def recommend(
    report: ScanReport, tiers: Sequence[float] = DEFAULT_TIERS, *, keep_fraction: float = KEEP_BELOW,
    total_steps: int = 1000, sensitivity: SensitivityReport | None = None,
) -> Recommendation:
    """The recommendation for a report (see the module docstring for the rule). With a
    `sensitivity` report of the same run, the sites kept in high precision follow its ranking
    instead (`follow_sensitivity`). Sites that a rotation measured in the report heals are
    rotated first (`with_rotation`); the rule then judges the report with them rotated."""
    judged = replace(report, rows=[r for r in report.rows if not is_kv_row(r)], _cache=None)
    fos = fos_remedy.choose(judged)
    if fos is not None and fos.report is not None:
        judged = fos.report  # the flagged sites it clears are fine, its rules' weights with it
    label, healed, residual = healed_sites(judged)
    rec = _by_weight_error(residual, tiers, keep_fraction=keep_fraction, total_steps=total_steps,
                           whole=report)
    if sensitivity is not None:
        rec = follow_sensitivity(residual, rec, sensitivity, tiers, total_steps=total_steps)
    if label is not None and healed:
        rec = with_rotation(report, rec, label, healed)
    if fos is not None:
        rec = with_four_over_six(report, rec, fos)
    return with_kv_cache(report, rec)


def with_four_over_six(report: ScanReport, rec: Recommendation, fos: fos_remedy.FosChoice) -> Recommendation:
    """`rec` (made on the report with four over six on the weights of `fos.rules`) with those
    quantize rules gaining `four_over_six` and its cost in words; `rec` as it is when the format
    changes (the finer format needs no NVFP4 remedy)."""
    if rec.kind == "change_format":
        return rec
    rules = [dict(r) for r in rec.policy["quantize"]]
    names = [r.get("name") or f"quantize[{i}]" for i, r in enumerate(rules)]
    wider = []
    for i in fos.rules:
        rules[i]["four_over_six"] = fos.mode
        if set(rules[i].get("tensors", ["weight"])) - {"weight"}:
            wider.append(names[i])
    gains = fos.cleared
    named = ", ".join(f"{s} {a:.1f} -> {b:.1f} dB, max/4 in {100 * share:.0f} % of blocks"
                      for s, a, b, share in gains[:SHOWN_DISAGREEMENTS])
    more = f" and {len(gains) - SHOWN_DISAGREEMENTS} more" if len(gains) > SHOWN_DISAGREEMENTS else ""
    plural = len(fos.rules) > 1
    text = (f"Four over six ({fos.mode}) clears {len(gains)} flagged NVFP4 site{'s' * (len(gains) > 1)} "
            f"({named}{more}); rule{'s' * plural} {', '.join(names[i] for i in fos.rules)} "
            f"take{'' if plural else 's'} four_over_six \"{fos.mode}\". Cost: {fos_remedy.cost_text()}.")
    if wider:
        text += (f" {', '.join(wider)} also quantize{'' if len(wider) > 1 else 's'} activations: "
                 "four over six applies to them too (quantization time at every call; this weight "
                 "scan did not measure them).")
    still = rec.kept_sites or rec.rotated_sites or "noise" in rec.policy
    summary = {"alternative": fos.label, "mode": fos.mode, "rules": list(fos.rules),
               "rows": [s for s, _, _, _ in gains], "max4_share": {s: share for s, _, _, share in gains}}
    return Recommendation(rec.kind if still else "four_over_six", rec.share, rec.problematic_layers,
                          rec.kept_layers, rec.kept_sites, text + (" " + rec.text if still else ""),
                          validated({**rec.policy, "quantize": rules}), rec.ranking,
                          rec.disagreements, rec.rotated_sites, rec.kv_cache, summary)


def with_kv_cache(report: ScanReport, rec: Recommendation) -> Recommendation:
    """`rec` (made without the key/value rows) with its flagged key/value rows remedied: each KV
    rule rewritten to the cheapest measured rung that clears its flagged rows (scan/kv_remedy.py;
    the `engine` section the rung needs), and the sites no rung clears kept out of their KV rule;
    the text says what the rung costs and which engines run it. `rec` as it is without flags."""
    choices, bare = kv_choices(report)
    if not choices and not bare:
        return rec
    rules = [dict(r) for r in rec.policy["quantize"]]
    names = [r.get("name") or f"quantize[{i}]" for i, r in enumerate(rules)]
    policy = {k: v for k, v in rec.policy.items() if k != "quantize"}
    texts = []
    for choice in choices:
        if choice.label is not None:
            rules[choice.rule] = rewritten(rules[choice.rule], choice.fields)
            if choice.engine is not None:
                policy["engine"] = dict(choice.engine)
        texts.append(_kv_text(choice, names[choice.rule]))
    kept = list(dict.fromkeys([*bare, *(s for c in choices for s in c.kept)]))
    if bare:
        texts.append(f"No finer KV scales were measured for {', '.join(bare)}: keep "
                     f"{'their' if len(bare) > 1 else 'its'} keys and values in 16 bits.")
    rules = ignoring(rules, kept, set(kept))
    empty = [i for i, rule in enumerate(rules) if _attention_rule(rule)
             and _kv_sites(report, i) <= set(rule.get("ignore", []))]  # nothing left to quantize
    policy["quantize"] = [rule for i, rule in enumerate(rules) if i not in empty]
    if empty:
        texts.append(f"Rule{'s' * (len(empty) > 1)} {', '.join(names[i] for i in empty)} then "
                     "quantize no site and go.")
    text = " ".join(texts)
    alone = not rec.kept_sites and rec.kind == "keep_high_precision" and "noise" not in rec.policy
    summary = [{"rule": c.rule, "alternative": c.label, "rows": [r for r, _, _ in c.cleared],
                "kept": c.kept} for c in choices]
    if bare:
        summary.append({"rule": None, "alternative": None, "rows": [], "kept": bare})
    return Recommendation("kv_cache" if alone else rec.kind, rec.share, rec.problematic_layers,
                          rec.kept_layers, list(dict.fromkeys([*rec.kept_sites, *kept])),
                          text if alone else f"{rec.text} {text}", validated({"version": 1, **policy}),
                          rec.ranking, rec.disagreements, rec.rotated_sites, summary, rec.four_over_six)


def _kv_sites(report: ScanReport, rule: int) -> set[str]:
    """The attention sites whose key/value rows rule `rule` quantized (its measured rungs name
    it); every attention site of the report where no row names its rule."""
    named = {r.site for r in report.rows if is_kv_row(r) and r.remedies
             and next(iter(r.remedies.values()))["rule"] == rule}
    return named or attention_sites(report)


def _kv_text(choice: KVChoice, rule: str) -> str:
    """One KV rule's remedy in words: which rung clears which rows, at what cost, what is kept."""
    text = ""
    if choice.label is not None:
        named = ", ".join(f"{r} {a:.1f} -> {b:.1f} dB" for r, a, b in choice.cleared[:SHOWN_DISAGREEMENTS])
        more = f" and {len(choice.cleared) - SHOWN_DISAGREEMENTS} more" if len(choice.cleared) > SHOWN_DISAGREEMENTS else ""
        engine = " (with the engine section it needs)" if choice.engine is not None else ""
        text = (f"KV cache: {choice.label} clears {len(choice.cleared)} flagged key/value "
                f"row{'s' * (len(choice.cleared) > 1)} ({named}{more}), the cheapest measured scales "
                f"that do; rule {rule} takes them{engine}. Cost: "
                f"{cost_text(choice.label, choice.fields, choice.engine)}.")
    if choice.kept:
        text += (f"{' ' if text else ''}No measured KV scales clear {', '.join(choice.kept)}: keep "
                 f"{'their' if len(choice.kept) > 1 else 'its'} keys and values in 16 bits (out of "
                 f"rule {rule}).")
    return text


def with_rotation(report: ScanReport, rec: Recommendation, label: str, healed: list[str]) -> Recommendation:
    """`rec` (made on the report with `healed` rotated) with the `rotate` rule that heals them
    and the costs that make it the cheaper remedy (scan/remedy.py): the rotation's online
    additions per input element against the bits per weight higher precision would add."""
    rotation = Rotation.parse(label)
    rows = {r.site: r for r in report.rows}
    fmt = str(report.meta.get("format"))
    gains = [(s, rows[s].metrics["sqnr_db"], rows[s].remedies[label]["metrics"]["sqnr_db"]) for s in healed]
    named = ", ".join(f"{s} {a:.1f} -> {b:.1f} dB" for s, a, b in gains[:SHOWN_DISAGREEMENTS])
    more = f" and {len(gains) - SHOWN_DISAGREEMENTS} more" if len(gains) > SHOWN_DISAGREEMENTS else ""
    length = rows[healed[0]].shape[0 if rows[healed[0]].kind == "conv1d" else -1]
    cost = f"{rotation.online_adds(length)} additions per input element online, no extra bit"
    if fmt in formats.names():
        bits = effective_bits(fmt, report.meta.get("options") or {})
        finer = finer_format(fmt)
        alt = f"{HIGH_PRECISION_BITS - bits:.2f} more bits per weight kept in high precision"
        if finer is not None:
            alt += f", {effective_bits(finer) - bits:.2f} more in {finer}"
        cost += f" (against {alt})"
    text = (f"A {label} rotation heals {len(healed)} flagged site{'s' * (len(healed) > 1)} "
            f"({named}{more}) at {cost}: rotate {'them' if len(healed) > 1 else 'it'}.")
    policy = {**rec.policy, "rotate": [rotation.rule(healed)]}
    still = rec.kept_sites or rec.kind == "change_format" or "noise" in rec.policy
    return Recommendation(rec.kind if still else "rotate", rec.share, rec.problematic_layers,
                          rec.kept_layers, rec.kept_sites, text + (" " + rec.text if still else ""),
                          validated(policy), rec.ranking, rec.disagreements, healed)


def _by_weight_error(report: ScanReport, tiers: Sequence[float], *, keep_fraction: float,
                     total_steps: int, whole: ScanReport | None = None) -> Recommendation:
    """The rule of the module docstring on `report`'s flags; a layer kept in high precision
    keeps every site `whole` (default: `report`) has in it, its attention included."""
    every = whole or report
    attention = attention_sites(every)
    layers = report.layers()
    bad_rows = [row for row, _ in report.problems()]
    bad_layers = report.problematic_layers()
    loose = [r.site for r in bad_rows if r.layer is None]  # e.g. lm_head: always kept when bad
    units = len(layers) if layers else len(report.rows)
    share = (len(bad_layers) if layers else len(bad_rows)) / units if units else 0.0
    fmt = str(report.meta.get("format"))
    sqnr = report.layer_sqnr()
    rules = _rules(report)

    new = finer_format(fmt)
    if share > CHANGE_ABOVE and new is not None:
        for rule in rules:
            if _attention_rule(rule):  # a KV format is judged on its own rows
                continue
            for key in FORMAT_KEYS:
                rule.pop(key, None)
            rule["format"] = new
        text = (f"{len(bad_layers)} of {len(layers)} layers ({100 * share:.0f} %) have problematic sites: "
                f"{fmt} is too coarse for this model; try {new} (check with `qtransform compare MODEL "
                f"--formats {fmt},{new}`).")
        return Recommendation("change_format", share, bad_layers, [], [], text,
                              validated({"version": 1, "quantize": rules}))

    if share < KEEP_BELOW or share > CHANGE_ABOVE or not layers:  # the last two: nothing better to do
        kept = list(dict.fromkeys([r.site for r in every.rows if r.layer in set(bad_layers)] + loose))
        what = f"layers {_layer_text(bad_layers)}" if bad_layers else ""
        what += (" and " if what and loose else "") + ", ".join(loose)
        text = "No problematic sites: quantize every scanned weight." if not kept else (
            f"{100 * share:.0f} % {'of layers are' if layers else 'of sites are'} problematic: keep "
            f"{what} in high precision ({len(kept)} sites) and quantize the rest"
            + (f" ({fmt} has no finer format to move to)." if share > CHANGE_ABOVE else "."))
        policy = {"version": 1, "quantize": ignoring(rules, kept, attention)}
        return Recommendation("keep_high_precision", share, bad_layers, bad_layers, kept, text, validated(policy))

    budget = max(1, math.floor(keep_fraction * len(layers)))
    kept_layers = sorted(sorted(bad_layers, key=lambda k: (_nan_last(sqnr[k]), k))[:budget])
    kept = list(dict.fromkeys([r.site for r in every.rows if r.layer in set(kept_layers)] + loose))
    rest = [k for k in layers if k not in kept_layers]
    noise = aqn_section({k: sqnr[k] for k in rest}, tiers, total_steps=total_steps, layers=rest)
    text = (f"{len(bad_layers)} of {len(layers)} layers ({100 * share:.0f} %) are problematic: keep the "
            f"worst by SQNR ({_layer_text(kept_layers)}) in high precision and train the others with "
            f"SRDD-guided AQN (sigma x{'/'.join(f'{t:g}' for t in tiers)} by SQNR tier, worst first).")
    policy = {"version": 1, "quantize": ignoring(rules, kept, attention), "noise": noise}
    return Recommendation("high_precision_and_aqn", share, bad_layers, kept_layers, kept, text, validated(policy))


def follow_sensitivity(report: ScanReport, rec: Recommendation, sensitivity: SensitivityReport,
                       tiers: Sequence[float] = DEFAULT_TIERS, *, total_steps: int = 1000) -> Recommendation:
    """The weight-error recommendation `rec` with its kept sites chosen by end-to-end sensitivity:
    as many sites as the weight view keeps, the most sensitive ones, and in words where the two
    views disagree (a flagged site the sensitivity ranks low buys little kept in high precision;
    a top-ranked site with ordinary weight error matters through the model, not its tensor).
    A format change stays a format change (no site choice repairs a format too coarse)."""
    fmt, sens_fmt = report.meta.get("format"), sensitivity.meta.get("format")
    if "mixed" not in (fmt, sens_fmt) and fmt != sens_fmt:
        raise UserError(f"the sensitivity report ranks {sens_fmt} sites but the scan report scanned "
                        f"{fmt}: give reports of the same format")
    scanned = {r.site for r in report.rows}
    ranked = [r for r in sensitivity.ranked() if r.site in scanned]
    if not ranked:
        raise UserError("the sensitivity report and the scan report share no site: give the "
                        "sensitivity of the scanned model and policy")
    total = len(sensitivity.rows)
    method = "exact" if any(not math.isnan(r.exact) for r in ranked) else "estimate"
    rank = {r.site: r.rank for r in ranked}
    count = len([s for s in rec.kept_sites if s in rank])
    unjudged = [s for s in rec.kept_sites if s not in rank]  # not measured: weight error decides
    kept = [r.site for r in ranked[:count]] + unjudged if rec.kind != "change_format" else []
    flagged = {row.site: why for row, why in report.problems() if row.site in rank}
    low = [s for s in dict.fromkeys(flagged) if s not in kept]
    high = [s for s in kept[:count] if s not in flagged]
    notes = [f"weight scan flags {s} for {_reason(flagged[s])}, but {method} sensitivity ranks it "
             f"{_ordinal(rank[s])} of {total}: keeping it in high precision buys little"
             for s in low[:SHOWN_DISAGREEMENTS]]
    if len(low) > SHOWN_DISAGREEMENTS:
        notes.append(f"... and {len(low) - SHOWN_DISAGREEMENTS} more flagged sites ranked below the kept ones")
    if high:
        named = ", ".join(f"{s} {_ordinal(rank[s])}" for s in high[:SHOWN_DISAGREEMENTS])
        more = f" and {len(high) - SHOWN_DISAGREEMENTS} more" if len(high) > SHOWN_DISAGREEMENTS else ""
        notes.append(f"{method} sensitivity ranks {len(high)} sites the weight scan does not flag "
                     f"among the {count} most sensitive of {total} ({named}{more}): the model's "
                     "output depends on them more than their weight error shows")
    if rec.kind == "change_format":
        return Recommendation(rec.kind, rec.share, rec.problematic_layers, [], [],
                              rec.text + _agree_text(notes), rec.policy, method, notes)
    if unjudged:
        notes.append(f"the sensitivity did not measure {', '.join(unjudged)}: kept by weight error")
    if not kept:  # nothing flagged, nothing kept: the ranking only says where to look first
        return Recommendation(rec.kind, rec.share, rec.problematic_layers, [], [],
                              f"{rec.text} The {method} sensitivity ranks {ranked[0].site} first "
                              f"of {total}: the site to keep if one must be.", rec.policy, method, [])
    kept_layers = sorted({report_layer for report_layer in (
        next(r.layer for r in report.rows if r.site == s) for s in kept) if report_layer is not None})
    attention = attention_sites(report) | {r.site for r in sensitivity.rows
                                           if set(r.points) & set(ATTENTION_TENSORS)}
    policy: dict[str, Any] = {"version": 1, "quantize": ignoring(_rules(report), kept, attention)}
    if "noise" in rec.policy:
        sqnr = report.layer_sqnr()
        rest = [k for k in report.layers() if k not in kept_layers]
        if rest:
            policy["noise"] = aqn_section({k: sqnr[k] for k in rest}, tiers, total_steps=total_steps,
                                          layers=rest)
    top = kept[:count]
    what = (f"keep the {count} sites {method} sensitivity ranks highest in high precision "
            f"({', '.join(top[:SHOWN_DISAGREEMENTS])}{' ...' if count > SHOWN_DISAGREEMENTS else ''}), "
            "as many as the weight scan would keep" if count else "keep no site by sensitivity")
    text = (f"{rec.text} Following the {method} sensitivity ranking instead: {what}"
            + (" and train the others with SRDD-guided AQN." if "noise" in policy else ".")
            + _agree_text(notes))
    return Recommendation(rec.kind, rec.share, rec.problematic_layers, kept_layers, kept, text,
                          validated(policy), method, notes)


def _agree_text(notes: list[str]) -> str:
    if not notes:
        return " The weight-error view and the sensitivity ranking agree on these sites."
    return " Where the views disagree: " + "; ".join(notes) + "."


def _reason(reasons: list[str]) -> str:
    """The first flag reason's metric (`deadzone`, `SQNR`, ...), in a word or two."""
    first = reasons[0] if reasons else "its error"
    return first.split(" ", 1)[0] if first.split(" ", 1)[0] in ("SQNR", "deadzone", "saturation",
                                                                 "rel_rmse") else first


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def guide(
    report: ScanReport, tiers: Sequence[float] = DEFAULT_TIERS, *, total_steps: int = 1000, aqn: bool = False,
    sensitivity: SensitivityReport | None = None,
) -> dict[str, Any]:
    """The policy that carries out the report's recommendation (see `recommend`; with a
    `sensitivity` report, the kept sites follow its ranking).

    `aqn=True` asks for SRDD-guided AQN whatever the recommendation: the scanned format stays, the
    sites the recommendation keeps stay in high precision, every other layer gets a sigma tier.
    """
    rec = recommend(report, tiers, total_steps=total_steps, sensitivity=sensitivity)
    if not aqn or "noise" in rec.policy:
        return rec.policy
    rest = [k for k in report.layers() if k not in rec.kept_layers]
    sqnr = report.layer_sqnr()
    if not rest:
        raise UserError("the report has no decoder layers to put AQN on: guide it without AQN")
    quantize = rec.policy["quantize"]  # kept sites ignored, KV rules rewritten
    if rec.kind == "change_format":  # AQN keeps the scanned format of the Linear rules
        quantize = [r if _attention_rule(r) else s for r, s in zip(quantize, _rules(report), strict=True)]
    policy = {
        **rec.policy, "quantize": quantize,
        "noise": aqn_section({k: sqnr[k] for k in rest}, tiers, total_steps=total_steps, layers=rest),
    }
    return validated(policy)


def _nan_last(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _layer_text(layers: Sequence[int]) -> str:
    return format_layers(layers) if layers else "none"
