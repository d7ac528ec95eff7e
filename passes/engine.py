"""Engine pass: the selected attention modules run an inference engine's attention kernel.

The kernel (`core/attention_kernels.py`: vLLM's CPU attention, FlashAttention-3's or vLLM
Triton's FP8 forward) replaces the model's attention implementation inside each attention
site's graph (its "kernel" point), after the quantize rules' query, key and value quantizers, so
it reads what the engine's cache would hold. With the engine section absent nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core.attention_kernels import KERNELS
from qtransform.core.engines import PER_TOKEN_HEAD, check_cache, device_backend, fp8_attention
from qtransform.core.program import Program
from qtransform.core.sites import ATTENTION_KIND
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas.sections.engine import EngineSpec


class EngineAttention(nn.Module):
    """One attention module's engine kernel (`backend` of `engine`)."""

    def __init__(self, engine: str, backend: str, kv_cache_dtype: str = "fp8"):
        super().__init__()
        self.engine, self.backend, self.kv_cache_dtype = engine, backend, kv_cache_dtype
        self.kernel = KERNELS[backend]
        self.fp8 = fp8_attention(kv_cache_dtype)

    def extra_repr(self) -> str:
        return f"{self.engine} {self.backend}, kv_cache_dtype={self.kv_cache_dtype}"

    def forward(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Tensor | None, options: dict[str, Any]) -> tuple[Tensor, None]:
        return self.kernel(module, query, key, value, attention_mask, options, self.fp8)


@register_pass
class EnginePass(Pass[EngineSpec, EngineSpec]):
    """Puts `EngineAttention` at the kernel point of every selected attention site."""

    name = tag = section = "engine"
    provides = (name,)
    modes = ("module",)  # it replaces an attention call inside its attention site's graph

    def select(self, program: Program, spec: EngineSpec) -> list[Action[EngineSpec]]:
        return [Action(site, "kernel", "engine", spec)
                for site in select_sites(program, spec, "engine", kinds=(ATTENTION_KIND,))]

    def build(self, program: Program, action: Action[EngineSpec]) -> nn.Module:
        spec = action.payload
        backend = resolved(program.model, spec.backend, spec.kv_cache_dtype)
        check_cache(spec.kv_cache_dtype, backend)
        return EngineAttention(spec.name, backend, spec.kv_cache_dtype)

    def describe(self, action: Action[EngineSpec]) -> str:
        spec = action.payload
        return f"{spec.name} {spec.backend} attention kernel (kv_cache_dtype {spec.kv_cache_dtype})"


def resolved(model: nn.Module, backend: str, kv_cache_dtype: str = "fp8") -> str:
    """`backend`, with "auto" resolved from the model's device (`core.engines.device_backend`);
    a per-token-head cache runs on vLLM's Triton attention wherever it runs."""
    if backend != "auto":
        return backend
    if kv_cache_dtype in PER_TOKEN_HEAD:
        return "triton"
    return device_backend(next((p.device for p in model.parameters()), torch.device("cpu")))
