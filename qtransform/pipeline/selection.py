"""Selecting sites of a Program with the policy's selectors.

The matcher itself (globs, `re:`, class names, layer ranges, precedence) lives in
`qtransform.schemas.selectors`; this module applies it to a captured model and turns "matched
nothing" into an error that names the entry and the closest site names, because a filter that
silently matches zero layers is how whole series of experiments ran without their noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qtransform.core.program import Program
from qtransform.core.sites import Site, closest_names
from qtransform.errors import UserError
from qtransform.pipeline.base import Action
from qtransform.schemas import QuantRule
from qtransform.schemas.selectors import Selector, resolve_quant_rules

QUANTIZABLE = ("linear", "conv1d")


def select_sites(program: Program, section: Any, where: str, *, kinds: tuple[str, ...]) -> list[Site]:
    """Sites of the given kinds matched by a policy section's targets/ignore/layers.

    Raises UserError when a target or ignore entry matches no site of those kinds, or when the
    section as a whole selects nothing.
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
    for entry in selector.unmatched_entries(candidates):
        hint = closest_names(entry, names)
        raise UserError(
            f"{where}: {entry!r} matches no {'/'.join(kinds)} site"
            + (f"; closest site names: {', '.join(hint)}" if hint else "")
        )
    chosen = [s for s in candidates if selector.matches(s)]
    if not chosen:
        raise UserError(
            f"{where}: selects no site (targets {list(section.targets)}, ignore {list(section.ignore)}"
            f", layers {section.layers!r}); the model has {len(candidates)} {'/'.join(kinds)} sites"
            + (f" such as {', '.join(names[:3])}" if names else "")
        )
    return chosen


def rule_label(section: str, index: int, name: str | None) -> str:
    return f"{section}[{index}]" + (f" {name!r}" if name else "")


def resolve_quantize(program: Program, rules: Sequence[QuantRule]) -> list[Action]:
    """One action per (site, tensor); a later rule overrides an earlier one for the same pair."""
    for i, rule in enumerate(rules):
        select_sites(program, rule, f"quantize[{i}]", kinds=QUANTIZABLE)  # errors for dead entries
    quantizable = [s for s in program.sites.values() if s.kind in QUANTIZABLE]
    chosen = resolve_quant_rules(rules, quantizable)
    order = {name: k for k, name in enumerate(program.sites)}
    points = {"weight": 0, "input": 1, "output": 2}
    return [
        Action(program.sites[name], tensor, rule_label("quantize", i, rule.name), {"rule": rule})
        for (name, tensor), (i, rule) in sorted(
            chosen.items(), key=lambda kv: (order[kv[0][0]], points[kv[0][1]]))
    ]
