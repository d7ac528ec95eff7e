"""The fast path of a transformed forward: a site whose only insertion is a cached weight
computes `linear(x, cached, bias)` itself, its weight checked at the model's entry.

Inside a real forward each site's Python runs with cold caches (a matmul streamed megabytes
through them since the last site), so every object a site's call touches costs cache misses:
the inserted module's call and the check of its weight were most of a W4A16 model's 4-9 % over
the original on SmolLM2-135M (docs/benchmarks.md). `WeightCheck`, forward hooks on the model's
root, runs at the entry of a forward the weight check of every such site (`cached_weight`: the
`Watch` check the module's call would run, in the same context) in one loop and arms the site
with the cached copy; the armed site's call (`ShortcutForward`) compares the weight's object,
data pointer and version counter with those the check saw and calls `F.linear`.

Outside a rollout block an armed copy serves one call of that forward. Inside one, where the
module's own check is the weight's identity after the block's first forward, the copy armed at
the block's first forward serves every call of the block while the weight's object, data
pointer and version counter are those it was checked with and `versions.recheck()` has not run
since (a block's entry and exit, a fake quantizer switched or its model's `train()`/`eval()`
run it; the block's other entries do nothing). A second call in the same forward outside a
block (a module called twice, gradient checkpointing), a call outside the model's forward, and
a call that finds anything else (traced by torch.export/compile, a LoRA forward shadowing the
weight, a gradient through the weight, another weight) run the site's graph, whose module call
does its own check.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.modules import module as _nn_module

from qtransform.core import ops, versions
from qtransform.core.phase import in_rollout
from qtransform.core.tracing import ACCELERATE_HOOK, GraphForward, ModuleGraph


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run hooks (its own or global ones)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks)


def _weight_module(state: ModuleGraph) -> str | None:
    """The child name of the one insertion of a plain `nn.Linear` site, where that insertion is
    a weight module with a cache (`cached_weight`) and the graph is the traced linear."""
    module, insertions = state.module, state.insertions
    if type(module) is not nn.Linear or len(insertions) != 1 or insertions[0].point != "weight":
        return None
    name = insertions[0].module_path.rsplit(".", 1)[-1]
    if not hasattr(module._modules.get(name), "cached_weight"):
        return None
    calls = [(n.op, n.target) for n in state.graph.nodes
             if n.op not in ("placeholder", "get_attr", "output")]
    if calls != [("call_module", name), ("call_function", torch._C._nn.linear)]:
        return None
    return name


class ShortcutForward(GraphForward):
    """The instance forward of such a site: `linear(x, cached, bias)` when armed (bit for bit
    what its graph computes), its graph otherwise."""

    def __init__(self, state: ModuleGraph, name: str):
        super().__init__(state)
        self.name = name  # the weight module's child name
        self.entry: WeightCheck | None = None  # the root hooks that arm this site
        # (cached copy, weight, its version, its data pointer, the entry's stamp, the rollout
        # block's recheck count or None outside a block)
        self.armed: tuple | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"state": self.state, "name": self.name}  # a copy is armed by its own entry

    def __setstate__(self, data: dict[str, Any]) -> None:
        self.__init__(data["state"], data["name"])

    def arm(self, stamp: int, block: int | None) -> None:
        """At the model's entry: check the weight as the module's call would, and keep the cached
        copy where the call may skip the module."""
        self.armed = None
        module = self.state.module
        if self.name in module.__dict__ or "weight" in module.__dict__:
            return
        inserted = module._modules.get(self.name)
        weight = module._parameters.get("weight")
        if inserted is None or weight is None or _hooked(inserted):
            return
        cached = inserted.cached_weight(weight)
        if cached is not None:
            self.armed = (cached, weight, weight._version, weight.data_ptr(), stamp, block)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        armed = self.armed
        module = self.state.module
        if armed is not None and len(args) == 1 and not kwargs:
            shadowed = module.__dict__
            weight = module._parameters["weight"]
            if (weight is armed[1] and weight._version == armed[2] and weight.data_ptr() == armed[3]
                    and "weight" not in shadowed and "bias" not in shadowed
                    and self.name not in shadowed
                    and not (weight.requires_grad and torch.is_grad_enabled())):
                if armed[5] is None:  # one call of the forward whose entry armed it
                    self.armed = None
                    if armed[4] == self.entry.stamp:
                        return F.linear(args[0], armed[0], module._parameters["bias"])
                elif armed[5] == versions._epoch:  # the block it was armed in (read directly:
                    # a call here costs 1-2 % of a decode step, docs/benchmarks.md)
                    return F.linear(args[0], armed[0], module._parameters["bias"])
        return self.fn(module, *args, **kwargs)


class WeightCheck:
    """Forward hooks on a transformed model's root: the entry arms every shortcut site, entry
    and exit (run also when the forward raises) move the stamp that a copy armed for one call
    must carry. An object, so the model pickles and deep-copies (a copy finds its own sites at
    its first forward)."""

    def __init__(self) -> None:
        self._sites: list[ShortcutForward] | None = None
        self.stamp = 0  # odd inside a forward
        self._block: int | None = None  # the recheck count of the rollout block last armed

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self.stamp += 1
        if ops.is_tracing(None):  # traced: every site runs its graph (the custom ops appear),
            for site in self._sites or ():  # also inside a rollout block armed before
                site.armed = None
            self._block = None
            return
        block = versions.epoch() if in_rollout() else None
        if block is not None and block == self._block:
            return  # armed at this block's first forward
        self._block = block
        if self._sites is None:
            self._sites = [f for m in module.modules()
                           if isinstance(f := m.__dict__.get("forward"), ShortcutForward)]
            for site in self._sites:
                site.entry = self
        for site in self._sites:
            site.arm(self.stamp, block)

    def end(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        self.stamp += 1


def install_shortcuts(model: nn.Module) -> None:
    """Give every eligible site of a transformed `model` its shortcut forward, and the model the
    hooks that arm them (idempotent)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if (type(forward) is GraphForward and ACCELERATE_HOOK not in module.__dict__
                and (name := _weight_module(forward.state)) is not None):
            module.__dict__["forward"] = ShortcutForward(forward.state, name)
    if not any(isinstance(h, WeightCheck) for h in model._forward_pre_hooks.values()):
        check = WeightCheck()
        model.register_forward_pre_hook(check)
        model.register_forward_hook(check.end, always_call=True)
