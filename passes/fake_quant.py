"""Fake-quant pass: quantize-dequantize the weights, inputs or outputs of selected sites.

Driven by the policy's ordered `quantize` rules; a later rule overrides an earlier one for the
same (site, tensor). Weights are quantized once and cached until the parameter changes
(`core.versions.Watch`: a forward with unchanged weights reads none of them), so a forward costs
what the original model costs; under FSDP the weight is quantized in every forward and nothing
is kept (a cached copy would be the unsharded weight on every rank).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.phase import in_rollout
from qtransform.core.program import Program
from qtransform.core.sharding import sharded
from qtransform.core.streams import DrawStream
from qtransform.core.versions import Watch, recheck
from qtransform.formats import QuantConfig
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import resolve_quantize
from qtransform.schemas import QuantRule


def weight_label(site: str) -> str:
    """The label of a site's weight fake-quant (its stream key and its node name in exports)."""
    return FakeQuantPass.label(site, "weight")


def expert_seed(seed: int, expert: int) -> int:
    """Expert `expert`'s stream seed when a fused experts weight is quantized expert by expert."""
    return (seed + expert) % 2**63


def first_weight_seed(config: QuantConfig, site: str, expert: int | None = None) -> int | None:
    """The stochastic-rounding seed the transformed model's first forward uses for this site's
    weight (expert): what a weight scan draws, so that it measures that very tensor. None for
    deterministic rounding."""
    if not config.stochastic:
        return None
    seed = DrawStream(config.seed or 0, weight_label(site)).seed_at(0)
    return seed if expert is None else expert_seed(seed, expert)


class _CachedSTE(torch.autograd.Function):
    """Returns the cached quantized weight; the gradient goes straight to the parameter."""

    @staticmethod
    def forward(ctx, weight: Tensor, quantized: Tensor) -> Tensor:  # noqa: ARG004
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class FakeQuantize(nn.Module):
    """Quantize-dequantize one tensor of a site in one format.

    On a weight (`cache=True`) the quantized copy is kept and reused while the parameter is
    unchanged (`core.versions.Watch`: a sample of the weight per forward outside rollouts, every
    byte at a rollout's entry and after `train()` / `eval()`; docs/rl.md says which writes are
    seen when). Under FSDP (`core.sharding.sharded`) there
    is no cache: the weight arrives all-gathered for this forward only, and a copy kept past the
    forward would be a full-size tensor on every rank. Under torch.export/compile the
    module emits the `qtransform::fake_quant` op, labelled `<site>/<tensor>_fake_quant`.

    With `per_expert` (a fused experts weight [E, ...]) each expert's matrix is quantized on its
    own, exactly as that matrix would be as an nn.Linear weight (`axis` is the axis of each
    matrix; NVFP4's tensor scale is one per expert); traced, that is one op per expert labelled
    `<label>.expert<e>` where the whole tensor at once would differ (a tensor scale, stochastic
    rounding), and one op otherwise.
    """

    def __init__(self, config: QuantConfig, label: str, *, cache: bool = False,
                 per_expert: bool = False, lora: str = "beside"):
        super().__init__()
        self.lora = lora  # how a LoRA adapter on this weight combines with it (core/lora.py)
        self.per_expert = per_expert
        self.config = config.bind(-1)  # an unbound axis means the last dim, as in fake_quantize
        self.label = label
        self.cache = cache and not config.stochastic
        # stochastic rounding: one draw per forward from the stream of the config's seed
        self.stream = DrawStream(config.seed or 0, label) if config.stochastic else None
        self._watch = Watch()
        self._cached: Tensor | None = None
        self.enabled = True

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.config.options().items())
        return f"{self.config.name}, {opts}, label={self.label!r}"

    @property
    def enabled(self) -> bool:
        """Eager only: off, the tensor passes unchanged (per-site sensitivity, parity)."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = on
        recheck()  # a cached copy armed for a rollout block is not used past a switch

    def set_step(self, step: int, draws: int = 0) -> None:
        if self.stream is not None:
            self.stream.set_step(step, draws)

    def _expertwise(self) -> bool:
        """Whether quantizing the whole [E, ...] tensor at once could differ from expert by
        expert: a per-tensor scale (NVFP4 two-level) or a stochastic stream."""
        cfg = self.config
        return self.per_expert and (cfg.stochastic or cfg.family.per_tensor(cfg))

    def quantize(self, x: Tensor) -> Tensor:
        """Quantize-dequantize `x` now, without the cache (rollout weights, stochastic draws);
        expert by expert where that differs from the whole tensor (each expert draws seed + e)."""
        seed = None if self.stream is None else self.stream.seed_at(self.stream.next_index(self.training))
        if not self._expertwise():
            return formats.fake_quantize(x, self.config, seed=seed)
        return torch.stack([
            formats.fake_quantize(x[e], self.config, seed=None if seed is None else expert_seed(seed, e))
            for e in range(x.shape[0])])

    def _traced(self, x: Tensor) -> Tensor:
        fmt, opts = self.config.name, self.config.to_json()
        if not self._expertwise():
            return torch.ops.qtransform.fake_quant(x, fmt, opts, self.label)
        return torch.stack([torch.ops.qtransform.fake_quant(x[e], fmt, opts, ops.expert_label(self.label, e))
                            for e in range(x.shape[0])])

    def clear_cache(self) -> None:
        """Drop the cached quantized weight (a sequential scan frees each layer after use)."""
        self._watch.forget()
        self._cached = None

    def train(self, mode: bool = True) -> FakeQuantize:
        self._watch.recheck()  # a change of mode is a point where every byte is checked
        recheck()  # ... also for a cached copy armed for a rollout block (core/shortcut.py)
        return super().train(mode)

    def quantized_copy(self, x: Tensor) -> Tensor:
        """The quantized copy of `x` without gradient, whether or not the module is enabled."""
        with torch.no_grad():
            return self.quantize(x.detach())

    def forward(self, x: Tensor) -> Tensor:
        if ops.is_tracing(x):
            return self._traced(x)
        if not self.enabled:
            return x
        if not self.cache or sharded(self):
            self.clear_cache()  # a copy cached before the model was sharded goes
            return self.quantize(x)
        cached = self._current(x)
        if torch.is_grad_enabled() and x.requires_grad:
            if self.config.zero_saturated_grad:
                return self.quantize(x)
            return _CachedSTE.apply(x, cached)
        return cached

    def cached_weight(self, weight: Tensor) -> Tensor | None:
        """What `forward(weight)` returns when that is the cached copy or, switched off, the
        weight itself; None otherwise (no cache, FSDP, a gradient through the weight): a site's
        shortcut (core/shortcut.py) computes with it without calling the module."""
        if not self.cache or sharded(self) or (weight.requires_grad and torch.is_grad_enabled()):
            return None
        return self._current(weight) if self.enabled else weight

    def _current(self, x: Tensor) -> Tensor:
        """The cached copy of `x`, quantized again if `x` changed since the last call."""
        if self._watch.changed(x, "identity" if in_rollout() else "sample") or self._cached is None:
            try:
                with torch.no_grad():
                    self._cached = self.quantize(x.detach())
            except BaseException:
                self.clear_cache()  # the watch has seen x, the cache has not
                raise
        return self._cached


@register_pass
class FakeQuantPass(Pass[list[QuantRule], QuantRule]):
    """Inserts `FakeQuantize` on every (site, tensor) the policy's `quantize` rules select."""

    name = tag = "fake_quant"  # the one spelling: other modules read FakeQuantPass.name / .label
    section = "quantize"
    provides = (name,)

    def select(self, program: Program, spec: list[QuantRule]) -> list[Action[QuantRule]]:
        return resolve_quantize(program, spec)

    def build(self, program: Program, action: Action[QuantRule]) -> nn.Module:
        site = action.site
        weight = action.point == "weight"
        config = action.payload.config().bind(site.reduction_axis if weight else -1)
        return FakeQuantize(config, self.label(site.name, action.point), cache=weight,
                            per_expert=site.kind == "experts" and weight, lora=action.payload.lora)

    def describe(self, action: Action[QuantRule]) -> str:
        return action.payload.config().describe()
