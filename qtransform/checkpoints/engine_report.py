"""What an inference engine computes differently from the producer's fake quantization, for a
checkpoint, backend by backend: one line per quantized Linear group and for the KV cache.

The words come from the homes of the simulation itself (`core/engines.py`,
`core/linear_kernels.py`, the KV rules of `checkpoints/policy.py`), so the report says what
`checkpoint_policy(model, engine=...)` computes and where it is not simulated. The export prints
it; `qtransform.engine_differences` returns it.
"""

from __future__ import annotations

from typing import Any

import torch

from qtransform.checkpoints.description import Checkpoint, Group
from qtransform.checkpoints.policy import engine_kv
from qtransform.core import engines, linear_kernels
from qtransform.errors import UserError
from qtransform.formats import registry

REPORTED = ("cpu", "flash-attn-3", "triton")  # the backends a report covers by default
REPORTED_NVFP4_KV = engines.NVFP4_READERS  # ... for a checkpoint with an NVFP4 KV cache
SCALE_FIELDS = ("scale_source", "observer")  # both sides use the stored scales


def differences(checkpoint: Checkpoint, backend: str, dtype: torch.dtype) -> list[str]:
    """Lines saying what vLLM on `backend` computes differently from the fake-quantized model
    of `dtype`, and whether qtransform simulates it."""
    lines = [_linears(g, backend, dtype, checkpoint.producer) for g in checkpoint.groups if g.weights is not None]
    if checkpoint.kv is not None:
        lines += _kv(checkpoint, backend)
    return lines or ["nothing: the checkpoint quantizes nothing the engine runs differently"]


def _linears(g: Group, backend: str, dtype: torch.dtype, producer: str) -> str:
    label = (f"Linears with weights {g.weights.label() if g.weights else '16-bit'}, activations "
             f"{g.inputs.label() if g.inputs else '16-bit'}")
    if backend != "cpu":
        gemm = f"{label}: {engines.gpu_linear_words(g.weights, g.inputs)} (from source; the GEMM not simulated"
        fp4 = engines.fp4_input_fields(g.inputs, producer, backend, None)
        if fp4 == {}:
            return f"{gemm}; simulated: the activations left in 16 bits, as Marlin runs weights only)"
        if fp4:
            return (f"{gemm}; the activations simulated: vLLM's scaled_fp4_quant with the stored "
                    "global scale, SF = e4m3(g · (amax · fl(1/6))), x · 1 / (SF · fl(1/g)), where "
                    "the fake quantization divides by SF / g)")
        return gemm + ")"
    try:
        kernel = engines.linear_kernel(g.weights, g.inputs, backend, dtype)
    except UserError as exc:
        return f"{label}: not simulated ({str(exc).split(': ', 1)[-1]})"
    return f"{label}: {linear_kernels.DIFFERENCES[kernel]} (simulated)"


def _kv(checkpoint: Checkpoint, backend: str) -> list[str]:
    label = f"KV cache {checkpoint.kv.label}"
    producer = checkpoint.kv.fields
    try:
        engine = engine_kv(producer, backend)
    except UserError as exc:
        return [f"{label}: not simulated ({exc})"]
    a, b = _options(producer), _options(engine)
    changed = [f"{k} {a.get(k)} → {b.get(k)}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)]
    writer = (f"the cache writer rounds as {', '.join(changed)}" if changed
              else "the cache writer rounds as the fake quantization does")
    lines = [f"{label}: {writer}, with the stored scales (simulated)"]
    if engines.query_rule("", backend) and engine["format"] == "fp8_e4m3":
        lines.append(f"{label}: the query is quantized to E4M3 too, with q_scale 1.0 (simulated)")
    how = {"trtllm-gen": "simulated from source; its steps inside inferred"}.get(
        backend, "simulated" if backend == "cpu" else "simulated from source")
    lines.append(f"{label}: attention computes as {engines.BACKEND_WORDS[backend]} ({how})")
    return lines


def _options(fields: dict[str, Any]) -> dict[str, Any]:
    """A rule's fields with its format's option defaults filled in (an unset option and its
    default are the same computation); the scale fields left out (both sides use the stored
    scales)."""
    out = {k: v for k, v in fields.items() if k not in SCALE_FIELDS and v is not None}
    options = registry.get(fields["format"]).options if fields["format"] in registry.names() else {}
    for option, values in options.items():
        out.setdefault(option, values[0])
    return out
