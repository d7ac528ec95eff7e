"""Shared tensor-level scales: weights that a serving stack quantizes with one global scale.

vLLM fuses q/k/v of an attention into one matmul and gate/up of an MLP into another, and needs
one NVFP4 global scale per fused matrix; llm-compressor therefore gives each such group the
global scale of the group's largest amax (`FUSED_LAYER_NAMES`, `update_fused_layer_weight_global_
scales`). `fused_groups` finds the same siblings in a site table; `ScaleGroup` is the shared amax
at run time: each member's fake-quant asks it before quantizing, it re-reads a member's amax
when that member's weight changed (`core.versions.Watch`, the check the weight cache uses) and
counts how often the group amax changed, so every member re-quantizes when any member's weight
moved the group amax. Under FSDP (no caches) it reads every member's amax at every call, from
the weights as the forward holds them (a sharded one reduced across ranks).

`quantizer_weight` is the one answer to "which tensor does a site's weight fake quantizer
quantize": the model's scale groups, the weight scan (`scan/seen.py`), the report page's
histograms and the checkpoint export all read a weight through it, so none of them measures or
stores another tensor than the transformed model quantizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from qtransform.core.rotation import apply_rotation
from qtransform.core.sites import Site
from qtransform.core.versions import Check, Watch

# leaf names that llm-compressor 0.14 fuses (observers/helpers.py FUSED_LAYER_NAMES): the same
# parent module holding all of one tuple
FUSED_NAMES: tuple[tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"),
)


def _user_name(site: Site) -> str:
    return site.alias or site.name


def fused_groups(sites: Sequence[Site]) -> list[list[Site]]:
    """The groups of `sites` a stack fuses: siblings under one parent whose leaf names form one
    of `FUSED_NAMES` (all of the tuple present among the model's sites), in site order.
    A fused `gate_up_proj` (one tensor) is a group by itself: each expert's gate/up already
    shares the tensor-level scale of that expert's matrix."""
    by_parent: dict[str, dict[str, Site]] = {}
    for site in sites:
        if site.adapter:
            continue
        parent, _, leaf = _user_name(site).rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = site
    groups = []
    for children in by_parent.values():
        for names in FUSED_NAMES:
            if all(n in children for n in names):
                members = [children[n] for n in names]
                if len({m.kind == "experts" for m in members}) == 1:
                    groups.append(members)
    return sorted(groups, key=lambda g: g[0].index)


def quantizer_weight(weight: Tensor, rotation: Tensor | None = None, axis: int = -1) -> Tensor:
    """The tensor a site's weight fake quantizer quantizes: W·R where the rotate pass rotates the
    weight (`rotation` its operand, R per block along the site's reduction axis `axis`), W as it
    is elsewhere, also where the weight is stored rotated (rule weight "stored", an opened rotated
    checkpoint: it holds W·R already, so its callers give no rotation). Never tracked by autograd."""
    weight = weight.detach()
    if rotation is None:
        return weight
    with torch.no_grad():
        return apply_rotation(weight, rotation, axis)


def group_amax(weights: Sequence[Tensor], per_expert: bool) -> Tensor:
    """A scale group's tensor-level amax: the largest of its members' (`weight_amax` of each
    member as `quantizer_weight` gives it), one per expert for fused experts weights."""
    return torch.stack([weight_amax(w, per_expert) for w in weights]).amax(dim=0)


def weight_amax(t: Tensor, per_expert: bool) -> Tensor:
    """max |t| in fp32: 0-dim, or one per expert ([E]) for a fused experts weight. NaN
    propagates. A sharded (DTensor) weight is reduced across its ranks."""
    dims = tuple(range(1, t.ndim)) if per_expert else tuple(range(t.ndim))
    amax = t.detach().abs().amax(dim=dims)
    if hasattr(amax, "full_tensor"):
        amax = amax.full_tensor()
    return amax.to(torch.float32)


class ScaleGroup:
    """The shared amax of a group of weights: the largest amax of its members.

    `members` are (site name, module holding the weight, parameter name). `amax(check)` returns
    the current group amax; `version` counts its changes, so a member's cached quantized weight is
    valid while its own weight and the version are unchanged.
    """

    def __init__(self, members: Sequence[tuple[str, nn.Module, str]], per_expert: bool):
        self.names = [name for name, _, _ in members]
        self._members = [(module, param) for _, module, param in members]
        self.per_expert = per_expert
        self._watches = [Watch() for _ in members]
        self._amaxes: list[Tensor | None] = [None] * len(members)
        self._amax: Tensor | None = None
        self.version = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_watches"] = [Watch() for _ in self._members]
        state["_amaxes"] = [None] * len(self._members)
        state["_amax"] = None
        return state

    def recheck(self) -> None:
        """Compare every byte at the next call (the owners' `train()` / `eval()`)."""
        for watch in self._watches:
            watch.recheck()

    def amax(self, check: Check | None = "sample") -> Tensor:
        """The group amax now; `check` None reads every member afresh (FSDP: no state kept)."""
        changed = False
        for i, (module, param) in enumerate(self._members):
            tensor = getattr(module, param)
            if check is None or self._amaxes[i] is None or self._watches[i].changed(tensor, check):
                self._amaxes[i] = weight_amax(_as_quantized(module, param, tensor), self.per_expert)
                changed = True
        if changed or self._amax is None:
            amax = torch.stack([a.to(self._amaxes[0].device) for a in self._amaxes]).amax(dim=0)
            if self._amax is None or not _same(amax, self._amax):
                self.version += 1
            self._amax = amax
        if check is None:
            self._amaxes = [None] * len(self._members)  # nothing outlives the forward
            amax, self._amax = self._amax, None
            return amax
        return self._amax

    def describe(self) -> str:
        return ", ".join(self.names)


def _as_quantized(module: nn.Module, param: str, tensor: Tensor) -> Tensor:
    """The member weight as its fake quantizer sees it: rotated where the rotate pass rotates it
    (its `weight_rotate` child; experts `<param>__weight_rotate`), so the shared scale is the
    rotated weights' (as llm-compressor computes it after fusing QuIP's transforms)."""
    rotate = module._modules.get("weight_rotate" if param == "weight" else f"{param}__weight_rotate")
    if rotate is None or not getattr(rotate, "enabled", False) or not hasattr(rotate, "operand"):
        return tensor
    return quantizer_weight(tensor, rotate.operand, rotate.axis)


def _same(a: Tensor, b: Tensor) -> bool:
    """Bit-equal (NaN equal to NaN)."""
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))
