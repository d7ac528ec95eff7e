"""The `engine` section: which inference engine and backend the model's attention and quantized
Linears simulate.

An engine's attention kernel computes its own numbers from the query, keys and values it reads:
vLLM's CPU backend runs everything in fp32; FlashAttention-3 and vLLM's Triton backend round the
probabilities to FP8 inside the kernel when the cache is FP8; FlashInfer reads an NVFP4 cache
with probabilities in the model's dtype (or E4M3 on Blackwell's trtllm-gen). This section puts that kernel in
place of the model's attention implementation on the selected attention modules; what the
cache stores (the keys' and values' format and scales) stays the quantize rules' (the `vllm/`
presets write both). docs/attention.md says what each backend computes and how it was checked.

`linears` (default none) names the Linears of a model opened from a quantized checkpoint that
compute as the engine's quantized-linear kernel computes for the checkpoint's scheme, from the
stored weights and scales (`core/linear_kernels.py`: vLLM's CPU backend); those Linears take no
input quantize rule (the kernel quantizes its input itself). docs/engines.md has the figures.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from qtransform.core.engines import BACKEND_WORDS, BACKENDS, ENGINES, KV_CACHE_DTYPES, check_cache
from qtransform.errors import UserError

from ..base import Entries, Selected, compiled_entries
from ..errors import Issue, problems_error
from ..words import describe_selector
from . import Section, register_section


class EngineSpec(Selected):
    """The engine and backend whose attention kernel the selected attention modules run."""

    targets: Entries = Field(default_factory=lambda: ["Attention"], min_length=1,
                             description="the attention modules (class names, globs or 're:')")
    name: Literal[ENGINES] = Field("vllm", description="the inference engine")  # type: ignore[valid-type]
    backend: Literal[BACKENDS] = Field(  # type: ignore[valid-type]
        "auto", description="its attention backend: auto (the model's device: cpu on CPU, "
        "flash-attn-3 on Hopper GPUs, triton on others; for an NVFP4 cache FlashInfer's kernel of "
        "the GPU), cpu (vLLM's CPU kernels), flash-attn-3, triton (vLLM's Triton attention), "
        "flashinfer, flashinfer-xqa, trtllm-gen (FlashInfer's readers of an NVFP4 cache on compute "
        "capability 8.x-9.x, 12.x, 10.x)")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] = Field(  # type: ignore[valid-type]
        "fp8", description="vLLM's kv_cache_dtype, which decides the kernel's own rounding: fp8, "
        "fp8_e4m3, fp8_e5m2 (the FP8 forward on GPU backends: probabilities rounded to E4M3), "
        "int8_per_token_head, fp8_per_token_head (Triton only; 16-bit probabilities), nvfp4, "
        "nvfp4_4over6 (FlashInfer's backends only; the latter trtllm-gen), auto (a 16-bit "
        "cache); what the cache stores is the quantize rules'")
    linears: Entries = Field(
        default_factory=list, description="the Linears (class names, globs or 're:') of a model "
        "opened from a quantized checkpoint that run the engine's quantized-linear kernel for the "
        "checkpoint's scheme (vLLM's CPU backend: W8A8 int8, FP8_DYNAMIC, W4A16); those the "
        "checkpoint leaves in high precision stay as they are; [] (default): none")

    @field_validator("linears")
    @classmethod
    def _linears_compile(cls, entries: list[str]) -> list[str]:
        return compiled_entries(entries)

    @model_validator(mode="after")
    def _backend_runs_the_cache(self) -> EngineSpec:
        try:
            check_cache(self.kv_cache_dtype, self.backend)
        except UserError as exc:
            raise problems_error([Issue(("kv_cache_dtype",), str(exc), self.kv_cache_dtype)]) from None
        return self


def describe(spec: EngineSpec) -> list[str]:
    lines = [f"Engine: the attention of {describe_selector(spec).rstrip(',')} computes as "
             f"{BACKEND_WORDS[spec.backend]}, kv_cache_dtype {spec.kv_cache_dtype}."]
    if spec.linears:
        lines.append(f"Engine: the checkpoint's quantized Linears among {', '.join(spec.linears)} "
                     f"compute as {spec.name}'s {spec.backend} quantized-linear kernels.")
    return lines


def summary(spec: EngineSpec) -> str:
    linears = ", quantized linears" if spec.linears else ""
    return f"engine ({spec.name} {spec.backend}, kv_cache_dtype {spec.kv_cache_dtype}{linears})"


register_section(Section("engine", EngineSpec | None, None, describe, summary, order=5,
                         description="the inference engine and backend whose attention kernel "
                                     "the model simulates",
                         example={"backend": "cpu"}))
