"""LoRA adapters around transformed sites: which weight a LoRA layer computes with.

PEFT wraps a transformed linear (`lora.Linear`, the site as its `base_layer`) and computes
`base_layer(x) + s * B(A(x))`. With the base weight fake-quantized that is quant(W) x + s B A x,
while an engine loaded with dense weights computes (quant(W) + s B A) x: the two are the same
model but not the same floats (the sums are rounded in another order), so a rollout computed by
one and scored by the other is off by rounding at every LoRA layer. The semantics is a choice of
the quantize rule (`lora`, described by `LORA_HELP`):

- "beside" (default; QeRL trains this way): adapters in full precision beside the quantized base.
  Training forwards run PEFT's own forward. Rollout forwards (`generate()`, `qtransform.rollout()`)
  compute with the dense weight quant(W) + s B A, which is exactly what `rollout_weights` sends
  and what an engine loaded with it computes; an engine that applies LoRA itself gets quant(W)
  and the adapters.
- "merged": quantization-aware training of the merged weight: every forward computes with
  quant(W + s B A), gradients reach A and B through the straight-through estimator, and the
  rollout weights are quant(W + s B A). LoRA dropout does not apply (the adapters are inside
  the weight).

A rotated site (the rotate pass: x·R and W·R) is a change of basis the adapters live outside of
by default (the rotate rule's `lora`, "unrotated"): PEFT's adapters see x, so the dense weight
adds the rotated delta, rot(W) and rot(s B A) alike. With lora "rotated" the adapters see x·R
(a forward pre-hook on each lora_A rotates its input), and the delta enters unrotated. A site
whose weight is stored rotated (the rotate rule's `weight` "stored": an opened rotated
checkpoint, W·R in the parameter, x·R online) keeps the same two meanings: "unrotated" adapters
add rot(s B A) to the stored weight, "rotated" ones s B A (they live in the weight's basis).

A dense forward runs the site's own graph with the dense weight in the weight slot and the
site's weight insertions passed over (the weight is final), so input-side insertions still apply
and the arithmetic is the original class's (`linear`, GPT-2's `addmm`).

`watch_lora(model)` makes this hold whichever order PEFT and the transform ran in: a forward
pre-hook on each module holding linears checks whether one was wrapped since (a dictionary
lookup per linear) and binds new LoRA layers (their instance forward becomes `LoraForward`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core.noise import NoiseModule
from qtransform.core.phase import in_rollout
from qtransform.core.tracing import module_graph
from qtransform.core.versions import Watch
from qtransform.errors import UserError

LORA_HELP = ("how a LoRA adapter on a quantized weight combines with it: 'beside' = quant(W) x + "
             "s B A x in training, adapters in full precision (QeRL), rollouts and rollout weights "
             "computed with the dense quant(W) + s B A; 'merged' = quant(W + s B A) in every "
             "forward and in the rollout weights (QAT of the merged weight, gradients to A and B "
             "straight through)")


def _passthrough(x: Tensor) -> Tensor:
    return x


def _changes_weight(child: object) -> bool:
    """Fake quantizers (`quantize`), rotations (`rotate_weight`) and noise modules."""
    return hasattr(child, "quantize") or hasattr(child, "rotate_weight") or isinstance(child, NoiseModule)


def weight_chain(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(child name, module) of the insertions that change `module`'s weight, in order: the
    rotations, fake quantizers and noise modules; observers (taps) are left out."""
    state = module_graph(module)
    if state is None:
        return []
    chain = []
    for ins in state.insertions:
        name = ins.module_path.rsplit(".", 1)[-1]
        child = module._modules.get(name)
        if ins.point == "weight" and _changes_weight(child):
            chain.append((name, child))
    return chain


def apply_chain(chain: list[tuple[str, nn.Module]], tensor: Tensor) -> Tensor:
    """`tensor` through a weight chain, without caches (gradients straight through); a fake
    quantizer switched off (`enabled`, as sensitivity scans do) passes it unchanged."""
    for _, module in chain:
        if hasattr(module, "rotate_weight"):
            tensor = module.rotate_weight(tensor)
        elif not hasattr(module, "quantize"):
            tensor = module(tensor)  # a noise module: its phase and switch apply
        elif getattr(module, "enabled", True):
            tensor = module.quantize(tensor)
    return tensor


def lora_mode(module: nn.Module) -> str:
    """The semantics of a base layer: its weight fake-quant's `lora`, "beside" without one."""
    return next((getattr(m, "lora", "beside") for _, m in weight_chain(module) if hasattr(m, "quantize")),
                "beside")


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer around a linear (duck-typed: PEFT is optional)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "lora_A")
            and hasattr(module, "get_delta_weight") and hasattr(module, "active_adapters"))


def _check_plain(layer: nn.Module) -> None:
    """LoRA variants (DoRA, ...) and adapter biases change more than W: not supported."""
    for adapter in _active(layer):
        if adapter in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(adapter):
            raise UserError(f"adapter {adapter!r} is a LoRA variant (DoRA, ...): qtransform's rollout "
                            "weights and LoRA semantics cover plain LoRA only; use use_dora=False")
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise UserError(f"adapter {adapter!r} has lora_bias=True: qtransform covers LoRA without "
                            "an adapter bias; use lora_bias=False")


def _active(layer: nn.Module) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def adapters_on(layer: nn.Module) -> bool:
    """Whether PEFT's own forward would add adapters now (not disabled, not merged into W)."""
    return bool(_active(layer)) and not layer.disable_adapters and not layer.merged


@contextmanager
def _shadowed(module: nn.Module, values: dict[str, Any]) -> Iterator[None]:
    """Instance attributes that shadow `module`'s parameters / children for one call."""
    for name, value in values.items():
        module.__dict__[name] = value
    try:
        yield
    finally:
        for name in values:
            module.__dict__.pop(name, None)


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def deltas(layer: nn.Module) -> list[Tensor]:
    """PEFT's delta weight (s B A) of each active adapter, as PEFT's merge adds them; adapter
    weights that the policy quantizes enter quantized (what the trainer's forward uses)."""
    _check_plain(layer)
    out = []
    for adapter in _active(layer):
        parts = (layer.lora_A[adapter], layer.lora_B[adapter])
        values = [{"weight": apply_chain(chain, _full(m.weight))} if (chain := weight_chain(m)) else {}
                  for m in parts]
        with _shadowed(parts[0], values[0]), _shadowed(parts[1], values[1]):
            out.append(_full(layer.get_delta_weight(adapter)))
    return out


def merge(weight: Tensor, layer_deltas: list[Tensor]) -> Tensor:
    """W + s B A, adapter after adapter, as PEFT's merge computes it."""
    for delta in layer_deltas:
        weight = (weight + delta).to(weight.dtype)
    return weight


def unmerge(weight: Tensor, layer_deltas: list[Tensor]) -> Tensor:
    """The base weight PEFT's unmerge leaves behind a merged one (adapters in reverse order)."""
    for delta in reversed(layer_deltas):
        weight = weight - delta.to(weight.dtype)
    return weight


def input_rotation(site: nn.Module) -> nn.Module | None:
    """The rotation on a site's input (the rotate pass's module), or None."""
    state = module_graph(site)
    for ins in state.insertions if state is not None else ():
        child = site._modules.get(ins.module_path.rsplit(".", 1)[-1])
        if ins.point == "input" and hasattr(child, "rotate_weight"):
            return child
    return None


def delta_rotations(site: nn.Module) -> list[tuple[str, nn.Module]]:
    """The rotations a LoRA delta s B A on `site` gets in the dense weight: none when the
    adapters see the rotated input (lora "rotated") or the site is not rotated; else the
    weight's (rot(s B A) beside rot(W)), or on a weight stored rotated the input's own
    rotation (a Linear's input and weight share the reduction axis, the last one)."""
    rotation = input_rotation(site)
    if rotation is None or getattr(rotation, "lora", "unrotated") != "unrotated":
        return []
    if not getattr(rotation, "stored_weight", False):
        return [(n, m) for n, m in weight_chain(site) if hasattr(m, "rotate_weight")]
    if not isinstance(site, nn.Linear):
        raise UserError(f"a LoRA adapter on a {type(site).__name__} whose weight is stored rotated "
                        "(rotate rule weight 'stored'): its delta cannot be rotated like the weight "
                        "outside an nn.Linear; set the rule's lora to 'rotated'")
    return [("input_rotate", rotation)]


def dense_weight(layer: nn.Module, base: Tensor | None = None) -> Tensor:
    """The one weight a LoRA layer's rollout computes with and its rollout weight carries:
    quant(W) + s B A ("beside") or quant(W + s B A) ("merged"), W the base weight (or `base`);
    on a rotated site rot(W) and, for adapters outside the rotation, rot(s B A)."""
    site = layer.base_layer
    chain = weight_chain(site)
    rotations = [(n, m) for n, m in chain if hasattr(m, "rotate_weight")]
    rest = [(n, m) for n, m in chain if not hasattr(m, "rotate_weight")]
    weight = apply_chain(rotations, _full(site.weight) if base is None else base)
    layer_deltas = [apply_chain(delta_rotations(site), d) for d in deltas(layer)]
    if lora_mode(site) == "merged":
        return apply_chain(rest, merge(weight, layer_deltas))
    return merge(apply_chain(rest, weight), layer_deltas)


class RotatedAdapterInput:
    """A forward pre-hook on a lora_A: its input x·R when the base layer's rotation says the
    adapters see the rotated input (lora "rotated"); x otherwise. An object, so models pickle."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        rotation = input_rotation(self.layer.base_layer)
        if rotation is None or getattr(rotation, "lora", None) != "rotated" or not args:
            return None
        return (rotation(args[0]), *args[1:])


class LoraForward:
    """The instance forward of a bound LoRA layer: PEFT's own forward where the semantics says
    so (training forwards with "beside", adapters off or merged, PEFT's mixed batches), else the
    base layer with the dense weight. The dense weight is cached while no gradient is needed and
    the weights are unchanged (`core.versions.Watch`); an object, so the model still pickles."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self._watches: list[Watch] = []
        self._key: tuple | None = None
        self._dense: Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"layer": self.layer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layer"])

    def __call__(self, x: Tensor, *args: object, **kwargs: object) -> Any:
        layer = self.layer
        dense = (not args and not kwargs and adapters_on(layer)
                 and (in_rollout() or lora_mode(layer.base_layer) == "merged"))
        if not dense:
            return type(layer).forward(layer, x, *args, **kwargs)
        site = layer.base_layer
        bypass = {name: _passthrough for name, _ in weight_chain(site)}
        with _shadowed(site, {"weight": self._weight(), **bypass}):
            return site(x)

    def _tensors(self) -> list[Tensor]:
        layer = self.layer
        return [layer.base_layer.weight, *(p for a in _active(layer)
                                           for p in (layer.lora_A[a].weight, layer.lora_B[a].weight))]

    def _weight(self) -> Tensor:
        layer = self.layer
        chain = weight_chain(layer.base_layer)
        tensors = self._tensors()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        if grad or any(getattr(m, "stream", None) is not None for _, m in chain):
            self._dense = None
            return dense_weight(layer)  # fresh: an autograd graph, or a random draw per forward
        key = (tuple(_active(layer)), tuple(layer.scaling[a] for a in _active(layer)),
               tuple(getattr(m, "enabled", True) for _, m in chain))
        if len(self._watches) != len(tensors):
            self._watches = [Watch() for _ in tensors]
        check = "identity" if in_rollout() else "sample"
        changed = [w.changed(t, check) for w, t in zip(self._watches, tensors, strict=True)]
        if any(changed) or key != self._key or self._dense is None:
            with torch.no_grad():
                self._dense = dense_weight(layer)
            self._key = key
        return self._dense


def bind(layer: nn.Module) -> None:
    """Give a PEFT LoRA layer the forward of its semantics (idempotent)."""
    if not isinstance(layer.__dict__.get("forward"), LoraForward):
        _check_plain(layer)
        layer.__dict__["forward"] = LoraForward(layer)
        for adapter in layer.lora_A.values():
            adapter.register_forward_pre_hook(RotatedAdapterInput(layer))


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every PEFT LoRA layer of `model`, bound to its semantics."""
    for name, module in model.named_modules():
        if is_lora_layer(module):
            bind(module)
            yield name, module


def _linear_like(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return weight is not None and weight.dim() == 2 and not is_lora_layer(module)


class LoraWatch:
    """A forward pre-hook on each module that holds linears: before the module runs, binds the
    LoRA layers PEFT put around its linears since (PEFT wraps after the transform in one order).
    A hook on the parent, not on the root, because PEFT calls the root's `forward` directly
    while every parent runs through `__call__`; the check is one dictionary lookup per linear."""

    def __init__(self, parent: nn.Module):
        self.slots = [[name, child, None] for name, child in parent._modules.items()
                      if child is not None and _linear_like(child)]

    def check(self, parent: nn.Module) -> None:
        """Bind every LoRA layer that now holds one of the parent's linears."""
        for slot in self.slots:
            name, child, seen = slot
            now = parent._modules.get(name)
            if now is seen:
                continue
            slot[2] = now
            if now is not child and is_lora_layer(now) and now.base_layer is child:
                bind(now)

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self.check(module)


def watch_lora(model: nn.Module) -> None:
    """Keep `model`'s LoRA layers on their semantics from now on, in either PEFT order."""
    for parent in model.modules():
        if is_lora_layer(parent) or isinstance(parent, nn.ModuleDict):
            continue
        if any(isinstance(h, LoraWatch) for h in parent._forward_pre_hooks.values()):
            continue
        watch = LoraWatch(parent)
        if watch.slots:
            parent.register_forward_pre_hook(watch)
    for module in model.modules():  # PEFT first: its LoRA layers are there already
        if is_lora_layer(module):
            bind(module)
