"""Selecting sites of a Program with the policy's selectors.

The matcher itself (globs, `re:`, class names, layer ranges, precedence) lives in
`qtransform.schemas.selectors`; this module applies it to a captured model and turns "matched
nothing" into an error that names the entry and the closest site names, because a filter that
silently matches zero layers is how whole series of experiments ran without their noise.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from qtransform.core.program import Program
from qtransform.core.scales import fused_groups
from qtransform.core.sites import ATTENTION_KIND, LINEAR_KINDS, ROUTER_ROLE, Site, closest_names
from qtransform.errors import UserError
from qtransform.pipeline.base import Action
from qtransform.pipeline.constraints import check_constraints
from qtransform.schemas import QuantRule
from qtransform.schemas.base import ATTENTION_TENSORS, Selected
from qtransform.schemas.presets import own_entries
from qtransform.schemas.selectors import (
    ROUTER_ENTRY,
    Selector,
    compile_entry,
    is_class_entry,
    resolve_quant_rules,
)


def select_sites(program: Program, section: Selected, where: str, *, kinds: tuple[str, ...]) -> list[Site]:
    """Sites of the given kinds matched by a policy section's targets/ignore/layers.

    Raises UserError when a target or ignore entry matches no site of those kinds (a preset's own
    entries excepted: they are listed in `program.preset_misses`), or when the section as a
    whole selects nothing.
    """
    selector = Selector.from_section(section)
    candidates = [s for s in program.sites.values() if s.kind in kinds]
    names = [s.name for s in candidates]
    if selector.layers is not None and not any(selector.in_layers(s) for s in candidates):
        present = sorted({s.layer for s in candidates if s.layer is not None})
        raise UserError(
            f"{where}: layers {selector.layers_spec!r} selects no site; the model's layers are "
            + (f"{present[0]}-{present[-1]}" if present else "not numbered")
        )
    lenient = own_entries(getattr(section, "name", None))
    for entry in selector.unmatched_entries(candidates):
        if entry in lenient:  # the preset's own entry: its stack skips it silently, so do we
            miss = f"{where} {section.name!r}: preset entry '{entry}' matches no site of this model (skipped)"
            if miss not in program.preset_misses:
                program.preset_misses.append(miss)
            continue
        raise UserError(f"{where}: {entry!r} matches no {'/'.join(kinds)} site" + _hint(entry, candidates))
    chosen = [s for s in candidates if selector.matches(s)]
    for name in selector.passed_routers(candidates):
        where_list = program.skipped_routers.setdefault(name, [])
        if where not in where_list:
            where_list.append(where)
    if not chosen:
        raise UserError(
            f"{where}: selects no site (targets {list(section.targets)}, ignore {list(section.ignore)}"
            f", layers {section.layers!r}); the model has {len(candidates)} {'/'.join(kinds)} sites"
            + (f" such as {', '.join(names[:3])}" if names else "")
        )
    return chosen


def check_axis(axis: int | None, site: Site, tensor: str, where: str) -> None:
    """A blocking axis must exist on the tensor: weights are 2-D (an experts weight is quantized
    expert by expert, so its axis is that of each expert's 2-D matrix), and inputs/outputs of a
    linear are at least 2-D ([..., features]), so only -2..1 is valid everywhere. Caught here, in plan,
    because an out-of-range axis otherwise surfaces as an ONNX file onnxruntime cannot load."""
    if axis is None or -2 <= axis <= 1:
        return
    shape = f" {list(site.weight_shape)}" if tensor == "weight" and site.weight_shape else ""
    raise UserError(f"{where}: axis {axis} does not exist on the {tensor}{shape} of {site.name}; "
                    "use -1 (the last axis, the default for activations) or -2, or drop axis "
                    "(the reduction axis)")


def _hint(entry: str, candidates: list[Site]) -> str:
    """For a class selector: the closest class names ("did you mean") and the classes this model
    has (only its norm classes for a norm selector); for a name selector: the closest site names."""
    if is_class_entry(entry):
        if entry.endswith("Norm"):
            candidates = [s for s in candidates if s.kind == "norm"]
        classes = sorted({s.cls_name for s in candidates}
                         | ({"Linear"} if any(s.kind in LINEAR_KINDS for s in candidates) else set())
                         | ({ROUTER_ENTRY} if any(s.role == ROUTER_ROLE for s in candidates) else set()))
        close = difflib.get_close_matches(entry, classes, n=3, cutoff=0.6)
        return ((f" (did you mean {' or '.join(close)}?)" if close else "")
                + (f"; the model's classes here: {', '.join(classes)}" if classes else ""))
    hint = closest_names(entry, [s.name for s in candidates])
    return f"; closest site names: {', '.join(hint)}" if hint else ""


def rule_label(section: str, index: int, name: str | None) -> str:
    return f"{section}[{index}]" + (f" {name!r}" if name else "")


def resolve_quantize(program: Program, rules: Sequence[QuantRule]) -> list[Action[QuantRule]]:
    """One action per (site, tensor); a later rule overrides an earlier one for the same pair.
    A rule on a Linear's tensors selects Linear sites, one on an attention's tensors attention
    sites."""
    for i, rule in enumerate(rules):  # errors for dead entries
        select_sites(program, rule, f"quantize[{i}]",
                     kinds=(ATTENTION_KIND,) if rule.attention else LINEAR_KINDS)
    chosen: dict[tuple[str, str], tuple[int, QuantRule]] = {}
    for kinds, attention in ((LINEAR_KINDS, False), ((ATTENTION_KIND,), True)):
        sites = [s for s in program.sites.values() if s.kind in kinds]
        own = [rule if rule.attention == attention else None for rule in rules]
        chosen |= resolve_quant_rules([r for r in own if r is not None], sites, indices=[
            i for i, r in enumerate(own) if r is not None])
    for name, _ in chosen:  # a later rule that names a router overrides the class rule passing it by
        if name in program.skipped_routers:
            program.skipped_routers[name] = [w for w in program.skipped_routers[name]
                                             if not w.startswith("quantize[")]
            if not program.skipped_routers[name]:
                del program.skipped_routers[name]
    for (name, tensor), (i, rule) in chosen.items():
        check_axis(rule.axis, program.sites[name], tensor, f"quantize[{i}]")
        check_constraints(program.sites[name], tensor, rule, f"quantize[{i}]")
    order = {name: k for k, name in enumerate(program.sites)}
    points = {p: k for k, p in enumerate(("weight", "input", "output", *ATTENTION_TENSORS))}
    return [
        Action(program.sites[name], tensor, rule_label("quantize", i, rule.name), rule)
        for (name, tensor), (i, rule) in sorted(
            chosen.items(), key=lambda kv: (order[kv[0][0]], points[kv[0][1]]))
    ]


def share_groups(program: Program, rules: Sequence[QuantRule],
                 actions: Sequence[Action[QuantRule]]) -> list[list[Site]]:
    """The weight groups that share one tensor-level scale (`share_scale` of the rules that
    quantize them): "fused" siblings (`core.scales.fused_groups`) or each explicit group (the
    sites its patterns match). A group must be quantized whole, by one rule: a member another
    rule quantizes, or that no rule does, is an error naming the members."""
    weight_rule = {a.site.name: a for a in actions if a.point == "weight"}
    sites = [s for s in program.sites.values() if s.kind in LINEAR_KINDS]
    groups: list[list[Site]] = []
    taken: dict[str, str] = {}
    for index, rule in enumerate(rules):
        own = {name for name, a in weight_rule.items() if a.payload is rule}
        if rule.share_scale == "tensor" or not own:
            continue
        where = rule_label("quantize", index, rule.name)
        if rule.share_scale == "fused":
            candidates = [g for g in fused_groups(sites) if any(s.name in own for s in g)]
        else:
            candidates = [_explicit_group(patterns, sites, where) for patterns in rule.share_scale]
        for group in candidates:
            _check_group(group, own, weight_rule, where)
            for site in group:
                if site.name in taken:
                    raise UserError(f"{where}: {site.name} is in two scale groups ({taken[site.name]}"
                                    f" and {', '.join(s.name for s in group)}); a weight shares one scale")
                taken[site.name] = ", ".join(s.name for s in group)
            groups.append(group)
    return groups


def _explicit_group(patterns: Sequence[str], sites: Sequence[Site], where: str) -> list[Site]:
    entries = [compile_entry(p) for p in patterns]
    for entry, text in zip(entries, patterns, strict=True):
        if not any(entry.matches(s) for s in sites):
            raise UserError(f"{where}: share_scale pattern {text!r} matches no site"
                            + _hint(text, list(sites)))
    return [s for s in sites if any(e.matches(s) for e in entries)]


def _check_group(group: list[Site], own: set[str], weight_rule: dict[str, Action[QuantRule]],
                 where: str) -> None:
    """Every member quantized by this very rule (one format, one set of options)."""
    others = [s for s in group if s.name not in own]
    if not others:
        return
    names = ", ".join(s.name for s in group)
    why = "; ".join(f"{s.name} is " + (f"quantized by {weight_rule[s.name].rule} "
                                        f"({weight_rule[s.name].payload.format})"
                                        if s.name in weight_rule else "not quantized")
                    for s in others)
    raise UserError(f"{where}: the scale group [{names}] shares one global scale, so every member "
                    f"must be quantized by this rule: {why}; quantize the whole group alike or "
                    'set share_scale to "tensor"')
