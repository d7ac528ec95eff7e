"""Engine pass: the selected attention modules run an inference engine's attention kernel, and
the selected quantized Linears its quantized-linear kernel.

The attention kernel (`core/attention_kernels.py`: vLLM's CPU attention, FlashAttention-3's or
vLLM Triton's FP8 forward) replaces the model's attention implementation inside each attention
site's graph (its "kernel" point), after the quantize rules' query, key and value quantizers, so
it reads what the engine's cache would hold; on vLLM's CPU backend the module's RoPE and its
decoder layer's residual norms become the engine's too (`core/engine_rotary.py`,
`core/engine_norms.py`). A Linear's kernel (`core/linear_kernels.py`)
replaces its linear op (the Linear site's "kernel" point) and computes from the input, the
stored weight codes and scales of the checkpoint the model was opened from: the input
quantization is the kernel's own. With the engine section absent nothing changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core import (
    attention_kernels,
    engine_norms,
    engine_rotary,
    flashinfer_kernels,
    linear_kernels,
)
from qtransform.core.engines import (
    NVFP4_KV,
    NVFP4_READERS,
    PER_TOKEN_HEAD,
    check_cache,
    device_backend,
    fp8_attention,
    linear_kernel,
    nvfp4_backend,
)
from qtransform.core.program import Program
from qtransform.core.sites import ATTENTION_KIND, Site
from qtransform.errors import UserError
from qtransform.formats.registry import E4M3
from qtransform.models import loaded_checkpoint
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas.base import Selected
from qtransform.schemas.sections.engine import EngineSpec

from .fake_quant import FakeQuantize

KERNELS = {**attention_kernels.KERNELS, **flashinfer_kernels.KERNELS}


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
        if self.backend == "cpu" and self.fp8:  # the cache's codes and scales, where there are
            scales = cache_scales(module)
            return self.kernel(module, query, key, value, attention_mask, options, scales is not None,
                               kv_scales=scales)
        if self.backend in NVFP4_READERS:  # the global scales outside the cache's code · SF
            scales = cache_scales(module)
            k_scale, v_scale = (1.0, 1.0) if scales is None else (float(scales[0]), float(scales[1]))
            return self.kernel(module, query, key, value, attention_mask, options, False,
                               kv_scales=(k_scale, v_scale))
        return self.kernel(module, query, key, value, attention_mask, options, self.fp8)


def cache_scales(module: nn.Module) -> tuple[Tensor, Tensor, str] | None:
    """The cache writer's (k_scale, v_scale, element) in attention `module`: its key and value
    quantizers' one fixed scale each (a stored, fixed or calibrated static scale, as the writer
    applies it), element an FP8 one or "nvfp4" (vLLM's NVFP4 cache: the global scale outside
    its blocks, amax / 448 when calibrated); None where they are switched off or have no such
    scale (a calibration pass): the kernel then reads the values as a 16/32-bit cache."""
    found = []
    for point in ("key", "value"):
        quantizer = getattr(module, f"{point}_fake_quant", None)
        if not isinstance(quantizer, FakeQuantize) or not quantizer.enabled:
            return None
        config = quantizer.config
        nvfp4 = config.name == "nvfp4" and config.nvfp4_variant in ("vllm-kv", "flashinfer-kv")
        if config.family.name != "fp8" and not nvfp4:
            return None
        level = quantizer.fixed_level()
        if "scale" in level:
            scale = level["scale"].to(torch.float32).reshape(())
        elif "amax" in level:
            amax = level["amax"].to(torch.float32).reshape(())
            scale = amax / (E4M3.max_normal if nvfp4 else config.spec.max_normal)  # NVFP4: amax / 448
            scale = torch.where(scale == 0, 1.0, scale)
        else:
            return None
        found.append(scale)
    config = module.key_fake_quant.config
    return found[0], found[1], "nvfp4" if config.name == "nvfp4" else config.spec.element.name


class EngineLinear(nn.Module):
    """One quantized Linear's engine kernel (`kernel` of `core/linear_kernels.py`): the weight's
    codes on the checkpoint's stored `scale` (the stored codes for the opened checkpoint's
    weights), computed as the engine computes."""

    def __init__(self, engine: str, backend: str, kernel: str, scale: Tensor):
        super().__init__()
        self.engine, self.backend, self.kernel = engine, backend, kernel
        self.scale = scale.detach().clone()  # not a buffer: the model's .to(dtype) must not round it

    def extra_repr(self) -> str:
        return f"{self.engine} {self.backend}, {self.kernel}"

    def forward(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        scale = self.scale.to(weight.device)
        codes = linear_kernels.weight_codes(weight.detach(), scale, linear_kernels.CODES[self.kernel])
        return linear_kernels.KERNELS[self.kernel](x, codes, scale, bias)


@register_pass
class EnginePass(Pass[EngineSpec, EngineSpec]):
    """Puts `EngineAttention` at the kernel point of every selected attention site, and
    `EngineLinear` at that of every selected quantized Linear."""

    name = tag = section = "engine"
    provides = (name,)
    modes = ("module",)  # it replaces an attention call inside its attention site's graph

    def select(self, program: Program, spec: EngineSpec) -> list[Action[EngineSpec]]:
        sites = select_sites(program, spec, "engine", kinds=(ATTENTION_KIND,))
        return [Action(site, "kernel", "engine", spec) for site in sites + quantized_linears(program, spec)]

    def build(self, program: Program, action: Action[EngineSpec]) -> nn.Module:
        spec = action.payload
        backend = resolved(program.model, spec.backend, spec.kv_cache_dtype)
        if action.site.kind != ATTENTION_KIND:
            return linear_module(program, action.site, spec, backend)
        check_cache(spec.kv_cache_dtype, backend)
        if backend == "cpu":  # its RoPE and the layer's residual norms too
            engine_rotary.install(program.model.get_submodule(action.site.module_name))
            install_norms(program.model, action.site.module_name)
        return EngineAttention(spec.name, backend, spec.kv_cache_dtype)

    def describe(self, action: Action[EngineSpec]) -> str:
        spec = action.payload
        if action.site.kind != ATTENTION_KIND:
            return f"{spec.name} {spec.backend} quantized-linear kernel"
        return f"{spec.name} {spec.backend} attention kernel (kv_cache_dtype {spec.kv_cache_dtype})"


def quantized_linears(program: Program, spec: EngineSpec) -> list[Site]:
    """The Linear sites `spec.linears` selects that the opened checkpoint quantizes (its
    high-precision ones run the engine's plain GEMM: they stay as they are)."""
    if not spec.linears:
        return []
    checkpoint = loaded_checkpoint(program.model)
    if checkpoint is None:
        raise UserError("engine.linears: the engine's linear kernels compute from a quantized "
                        "checkpoint's stored weights and scales; open one with load_model (a "
                        "compressed-tensors folder), or drop engine.linears")
    selector = Selected(targets=spec.linears, layers=spec.layers)
    sites = [s for s in select_sites(program, selector, "engine.linears", kinds=("linear",))
             if s.module_name in checkpoint.modules]
    if not sites:
        raise UserError(f"engine.linears: {spec.linears} selects none of the checkpoint's quantized "
                        "Linears; name them (e.g. [\"Linear\"]) or drop engine.linears")
    return sites


def linear_module(program: Program, site: Site, spec: EngineSpec, backend: str) -> EngineLinear:
    """The engine kernel of a quantized Linear site, for its checkpoint group's scheme."""
    checkpoint = loaded_checkpoint(program.model)
    assert checkpoint is not None
    group = checkpoint.groups[checkpoint.modules[site.module_name]]
    weight = program.model.get_submodule(site.module_name).weight
    try:
        kernel = linear_kernel(group.weights, group.inputs, backend, weight.dtype)
    except UserError as exc:
        raise UserError(f"{site.name}: {exc}") from None
    head = program.site_graph(site.name).heads.get("input")
    if head is not None and head.meta.get("qtransform", {}).get("pass") == "fake_quant":
        raise UserError(f"{site.name}: a quantize rule quantizes its input, which the engine's "
                        f"{kernel} kernel quantizes itself; leave this Linear out of the rule's "
                        "targets (checkpoint_policy(model, engine=...) does)")
    scale = checkpoint.weight_scales.get(site.module_name)
    if scale is None:
        raise UserError(f"{site.name}: the checkpoint stores no weight_scale for it; re-export it")
    return EngineLinear(spec.name, backend, kernel, scale)


def install_norms(model: nn.Module, attention: str) -> None:
    """vLLM's fused add + RMSNorm (`core/engine_norms.py`) around the decoder layer holding the
    attention module `attention` (its sibling before it, the model's final norm after the last)."""
    layer_path = attention.rpartition(".")[0]
    list_path, _, index = layer_path.rpartition(".")
    if not index.isdigit() or not list_path:
        return
    layers = model.get_submodule(list_path)
    if not isinstance(layers, nn.ModuleList):
        return
    i = int(index)
    owner = model.get_submodule(list_path.rpartition(".")[0]) if "." in list_path else model
    final = getattr(owner, "norm", None) if i == len(layers) - 1 else None
    engine_norms.install(layers[i], layers[i - 1] if i > 0 else None, final)


def resolved(model: nn.Module, backend: str, kv_cache_dtype: str = "fp8") -> str:
    """`backend`, with "auto" resolved from the model's device (`core.engines.device_backend`);
    a per-token-head cache runs on vLLM's Triton attention wherever it runs."""
    if backend != "auto":
        return backend
    if kv_cache_dtype in PER_TOKEN_HEAD:
        return "triton"
    if kv_cache_dtype in NVFP4_KV:
        reader = nvfp4_backend(next((p.device for p in model.parameters()), torch.device("cpu")))
        if reader is None:
            raise UserError(f"engine.backend auto: vLLM reads a {kv_cache_dtype} cache on GPUs only "
                            "(FlashInfer); name the GPU's kernel: backend flashinfer (compute "
                            "capability 8.x, 9.x), flashinfer-xqa (12.x) or trtllm-gen (10.x)")
        return reader
    return device_backend(next((p.device for p in model.parameters()), torch.device("cpu")))
