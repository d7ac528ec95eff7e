"""Fake-quant pass: quantize-dequantize the weights, inputs or outputs of selected sites.

Driven by the policy's ordered `quantize` rules; a later rule overrides an earlier one for the
same (site, tensor). Weights are quantized once and cached until the parameter changes (an
optimizer step bumps its version counter), so a forward costs what the original model costs.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.program import Program
from qtransform.core.versions import content_key
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import resolve_quantize
from qtransform.schemas import QuantRule


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

    On a weight (`cache=True`) the quantized copy is kept and reused while the parameter's
    content, dtype, device and shape are unchanged (`core.versions.content_key`: writes through
    `.data`, merges and FSDP2's reused storage are all seen). Under torch.export/compile the
    module emits the `qtransform::fake_quant` op, labelled `<site>/<tensor>_fake_quant`.
    """

    def __init__(self, fmt: str, options: dict[str, Any], label: str, *, axis: int = -1,
                 cache: bool = False, seed: int | None = None):
        super().__init__()
        self.fmt = formats.get(fmt).name
        self.options = {k: v for k, v in options.items() if v is not None}
        self.axis = axis
        self.label = label
        self.cache = cache and self.options.get("rounding", "rne") != "stochastic"
        self.seed = seed
        self._generator: torch.Generator | None = None
        self._key: tuple | None = None
        self._cached: Tensor | None = None
        self.enabled = True  # eager only: off, the tensor passes unchanged (per-site sensitivity)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.fmt}, axis={self.axis}{', ' + opts if opts else ''}, label={self.label!r}"

    def _opts(self) -> dict[str, Any]:
        return {**self.options, "axis": self.axis}

    def _gen(self, device: torch.device) -> torch.Generator | None:
        if self.options.get("rounding") != "stochastic":
            return None
        if self._generator is None or self._generator.device != device:
            seed = (self.seed or 0) * 1_000_003 + zlib.crc32(self.label.encode())
            self._generator = torch.Generator(device=device).manual_seed(seed)
        return self._generator

    def quantize(self, x: Tensor) -> Tensor:
        """The quantized copy of `x` without gradient, whether or not the module is enabled."""
        with torch.no_grad():
            return formats.fake_quantize(x.detach(), self.fmt, generator=self._gen(x.device), **self._opts())

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled and not ops.is_tracing(x):
            return x
        if ops.is_tracing(x):
            return torch.ops.qtransform.fake_quant(x, self.fmt, ops.encode_options(self._opts()), self.label)
        if not self.cache:
            return formats.fake_quantize(x, self.fmt, generator=self._gen(x.device), **self._opts())
        key = content_key(x)
        if key != self._key or self._cached is None:
            with torch.no_grad():
                self._cached = formats.fake_quantize(x.detach(), self.fmt, **self._opts())
            self._key = key
        if torch.is_grad_enabled() and x.requires_grad:
            if self.options.get("zero_saturated_grad"):
                return formats.fake_quantize(x, self.fmt, **self._opts())
            return _CachedSTE.apply(x, self._cached)
        return self._cached


@register_pass
class FakeQuantPass(Pass[list[QuantRule]]):
    """Inserts `FakeQuantize` on every (site, tensor) the policy's `quantize` rules select."""

    name = "fake_quant"
    tag = "fake_quant"
    section = "quantize"
    provides = ("fake_quant",)

    def select(self, program: Program, spec: list[QuantRule]) -> list[Action]:
        return resolve_quantize(program, spec)

    def build(self, program: Program, action: Action) -> nn.Module:
        rule = action.params["rule"]
        site = action.site
        axis = rule.axis if rule.axis is not None else (site.reduction_axis if action.point == "weight" else -1)
        label = f"{site.name}/{action.point}_fake_quant"
        return FakeQuantize(rule.format, rule.format_options(), label, axis=axis,
                            cache=action.point == "weight", seed=rule.seed)

    def describe(self, action: Action) -> str:
        rule = action.params["rule"]
        opts = rule.format_options()
        extras = ", ".join(f"{k}={v}" for k, v in opts.items() if k != "block_size")
        block = opts.get("block_size") or formats.get(rule.format).default_block
        return f"{rule.format} block={block}{', ' + extras if extras else ''}"
