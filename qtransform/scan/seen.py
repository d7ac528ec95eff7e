"""The scanned weights as a policy's fake quantizers see them, without transforming a model.

A weight scan reads tensors straight from a module or a checkpoint; the transformed model would
quantize W·R where its `rotate` rules rotate the weight, and quantize each member of a scale group
(`share_scale`: "fused" siblings such as q/k/v, or explicit groups) with the group's largest amax
(`core.scales`). `SeenWeights` holds both answers for a set of weights, from the rotate rules and
the groups, so the scan and the report page's histograms (which recompute from the same report
metadata: `meta["rotate"]`, `meta["scale_groups"]`) quantize the very tensors the model quantizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from qtransform.core.scales import fused_groups, group_amax, quantizer_weight
from qtransform.core.sites import Site
from qtransform.passes.rotate import Rotation, resolve_rotations
from qtransform.scan.sources import WeightRef
from qtransform.schemas import load_policy, resolve_quant_rules
from qtransform.schemas.selectors import compile_entry

if TYPE_CHECKING:
    from qtransform.schemas import PolicyLike


def scale_groups(policy: PolicyLike, sites: Sequence[Site]) -> list[list[str]]:
    """The groups of `sites` whose weights share one tensor-level amax under `policy` (site names,
    in site order): "fused" siblings all quantized by the same rule, or each explicit group's
    sites among that rule's own; rules whose format has no tensor-level scale share nothing."""
    rules = load_policy(policy).quantize
    owner = {name: rule for (name, tensor), (_, rule) in resolve_quant_rules(rules, sites).items()
             if tensor == "weight"}
    out: list[list[str]] = []
    for rule in rules:
        cfg = rule.config()
        if rule.share_scale == "tensor" or not cfg.family.per_tensor(cfg):
            continue
        own = [s for s in sites if owner.get(s.name) is rule]
        if rule.share_scale == "fused":
            groups = [g for g in fused_groups(sites) if all(owner.get(s.name) is rule for s in g)]
        else:
            groups = [[s for s in own if any(compile_entry(p).matches(s) for p in patterns)]
                      for patterns in rule.share_scale]
        out += [[s.name for s in g] for g in groups if g]
    return out


@dataclass
class SeenWeights:
    """Per scanned weight: the rotation its quantizer applies first and its scale group's amax."""

    refs: dict[str, WeightRef]
    rotations: dict[str, Rotation]
    groups: dict[str, list[str]]  # member name -> its group's members
    _amax: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, refs: Sequence[WeightRef], rotate: list[Any] | None = None,
           groups: Sequence[Sequence[str]] = ()) -> SeenWeights:
        """`rotate`: the policy's rotate rules (RotateRule objects or their JSON); `groups`:
        `scale_groups`' answer (members the scan does not read are ignored)."""
        by_name = {r.site.name: r for r in refs}
        rules = load_policy({"version": 1, "rotate": list(rotate or [])}).rotate
        members = [[n for n in g if n in by_name] for g in groups]
        return cls(by_name, resolve_rotations(rules, [r.site for r in refs]),
                   {n: g for g in members if g for n in g})

    def tensor(self, name: str, weight: torch.Tensor | None = None) -> torch.Tensor:
        """What the fake quantizer of `name` quantizes (`core.scales.quantizer_weight`), from
        `weight` when the caller has it loaded already."""
        ref = self.refs[name]
        w = ref.load() if weight is None else weight
        rotation = self.rotations.get(name)
        return quantizer_weight(w, None if rotation is None else rotation.operand, ref.site.reduction_axis)

    def amax(self, name: str) -> torch.Tensor | None:
        """The group amax `name` is quantized with (None: its own). Each member of a group is
        read once more, on first use, for the whole group."""
        group = self.groups.get(name)
        if group is None:
            return None
        if name not in self._amax:
            amax = group_amax([self.tensor(n) for n in group], self.refs[name].site.kind == "experts")
            self._amax.update(dict.fromkeys(group, amax))
        return self._amax[name]
