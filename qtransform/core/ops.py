"""Custom ops: what torch.export, torch.compile and the ONNX exporter see of qtransform.

Inserted modules run plain PyTorch in eager mode (fast paths, caches, accumulators) and call these
ops when traced, so an exported graph shows exactly one named node per fake-quant, tap, noise or rotate
insertion. A fake-quant's `QuantConfig` travels as its canonical JSON (`QuantConfig.to_json`)
because custom-op schemas take only simple types.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from qtransform import formats
from qtransform.core.noise_kinds import noise_kind
from qtransform.core.rotation import apply_rotation, unrotate
from qtransform.formats import QuantConfig

# besides the config, a fake-quant's options may name its tensor-level amax when it is not the
# input's own: "global_amax" (a fixed value: a calibrated static scale, a scale group's) or
# "global_scale": "token" (each row's own, NVFP4 activations); or "tensor_scale", the fixed
# tensor-level scale itself as a checkpoint stores it (`fake_quantize`'s scale=)
GLOBAL_KEYS = ("global_amax", "global_scale", "tensor_scale")


def op_config(fmt: str, options: str) -> tuple[QuantConfig, dict[str, Any]]:
    """The config and the tensor-level amax keys (GLOBAL_KEYS) of a fake-quant op's options."""
    opts = json.loads(options)
    extra = {k: opts.pop(k) for k in GLOBAL_KEYS if k in opts}
    return QuantConfig.from_options(fmt, opts), extra


def op_options(config: QuantConfig, extra: dict[str, Any] | None = None) -> str:
    """The options string of a fake-quant op: the config's JSON plus GLOBAL_KEYS."""
    if not extra:
        return config.to_json()
    return json.dumps({**json.loads(config.to_json()), **extra}, sort_keys=True)


def op_tensor_level(x: Tensor, config: QuantConfig, extra: dict[str, Any]) -> dict[str, Tensor]:
    """`fake_quantize`'s tensor-level keyword GLOBAL_KEYS give for `x`: {"amax": ...} or
    {"scale": ...}, or nothing for x's own amax."""
    if "tensor_scale" in extra:
        return {"scale": torch.tensor(float(extra["tensor_scale"]), dtype=torch.float32,
                                      device=x.device)}
    if "global_amax" in extra:
        return {"amax": torch.tensor(float(extra["global_amax"]), dtype=torch.float32, device=x.device)}
    if extra.get("global_scale") == "token":
        return {"amax": x.detach().abs().amax(dim=config.block_axis, keepdim=True).to(torch.float32)}
    return {}


@torch.library.custom_op("qtransform::fake_quant", mutates_args=())
def fake_quant(x: Tensor, fmt: str, options: str, label: str) -> Tensor:
    """Quantize-dequantize `x` in format `fmt` with the options of `QuantConfig.to_json` (plus
    GLOBAL_KEYS); `label` names the site tensor in exported graphs."""
    cfg, extra = op_config(fmt, options)
    return formats.fake_quantize(x.detach(), cfg, **op_tensor_level(x, cfg, extra)).clone()


@fake_quant.register_fake
def _(x: Tensor, fmt: str, options: str, label: str) -> Tensor:
    return torch.empty_like(x)


def _fq_setup(ctx, inputs, output) -> None:
    x, fmt, options, _label = inputs
    cfg, extra = op_config(fmt, options)
    ctx.mask = (formats.saturated(x.detach(), cfg, **op_tensor_level(x, cfg, extra))
                if cfg.zero_saturated_grad else None)


def _fq_backward(ctx, grad: Tensor):
    if ctx.mask is not None:
        grad = grad.masked_fill(ctx.mask, 0)
    return grad, None, None, None


fake_quant.register_autograd(_fq_backward, setup_context=_fq_setup)


@torch.library.custom_op("qtransform::tap", mutates_args=())
def tap(x: Tensor, label: str) -> Tensor:
    """Identity that marks a tapped value; exported graphs turn it into a named graph output."""
    return x.clone()


@tap.register_fake
def _(x: Tensor, label: str) -> Tensor:
    return torch.empty_like(x)


tap.register_autograd(lambda ctx, grad: (grad, None), setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("qtransform::noise", mutates_args=())
def noise(x: Tensor, z: Tensor, scale: float, kind: str, label: str) -> Tensor:
    """The registered noise kind `kind` (`core/noise.py`: "add" is x + scale*z, "relative"
    x*(1 + scale*z), ...) with the draw z given explicitly.

    The draw z is an input, not generated inside, so exported graphs can take it as a named
    graph input and reproduce PyTorch's run exactly.
    """
    return noise_kind(kind).apply(x, z, scale)


@noise.register_fake
def _(x: Tensor, z: Tensor, scale: float, kind: str, label: str) -> Tensor:
    return torch.empty_like(x)


def _noise_setup(ctx, inputs, output) -> None:
    _x, z, scale, kind, _label = inputs
    ctx.save_for_backward(z)
    ctx.scale, ctx.kind = scale, kind


def _noise_backward(ctx, grad: Tensor):
    (z,) = ctx.saved_tensors
    return noise_kind(ctx.kind).grad(grad, z, ctx.scale), None, None, None, None


noise.register_autograd(_noise_backward, setup_context=_noise_setup)


_TRACED = (torch.fx.Proxy, FakeTensor)  # what a traced forward sees instead of a tensor


def is_tracing(x: object) -> bool:
    """True under torch.export, torch.compile or fx symbolic tracing, where eager caches and
    Python-side accumulators must not run and the custom ops above must appear instead."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    return isinstance(x, _TRACED)


EXPERT_SUFFIX = ".expert"  # fused experts quantized expert by expert: `<label>.expert<e>` nodes
HEAD_SUFFIX = ".head"  # attention tensors with one scale per head: `<label>.head<h>` nodes


def expert_label(label: str, expert: int) -> str:
    """The label of one expert's node when a fused experts tensor is quantized expert by expert."""
    return f"{label}{EXPERT_SUFFIX}{expert}"


def split_expert_label(label: str) -> tuple[str, int | None]:
    """(the insertion's label, the part's index) of a node label: one expert's
    (`<label>.expert<e>`) or one head's (`<label>.head<h>`); None for a whole-tensor node."""
    for suffix in (EXPERT_SUFFIX, HEAD_SUFFIX):
        base, sep, index = label.rpartition(suffix)
        if sep and index.isdigit():
            return base, int(index)
    return label, None


@torch.library.custom_op("qtransform::rotate", mutates_args=())
def rotate(x: Tensor, operand: Tensor, kind: str, label: str) -> Tensor:
    """x rotated along its last axis per block (`core.rotation.apply_rotation`: `kind`'s
    Hadamard signs [b] or matrix [b, b]); `label` names the site tensor in exported graphs."""
    return apply_rotation(x, operand).clone()


@rotate.register_fake
def _(x: Tensor, operand: Tensor, kind: str, label: str) -> Tensor:
    return torch.empty_like(x)


def _rotate_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _rotate_backward(ctx, grad: Tensor):
    """The transpose of the rotation, per block: g·Mᵀ, or (g·H)·diag(s) (H is symmetric)."""
    (operand,) = ctx.saved_tensors
    return unrotate(grad, operand), None, None, None


rotate.register_autograd(_rotate_backward, setup_context=_rotate_setup)
