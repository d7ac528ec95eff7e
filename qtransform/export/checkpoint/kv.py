"""The KV cache a checkpoint can hold: what every attention module's key and value quantizers
share, and the scales they store.

A KV-cache scheme (compressed-tensors' `kv_cache_scheme`, ModelOpt's `kv_cache_quant_algo`) is
one format for the keys and values of every attention, with static scales stored per module: an
engine quantizes each key and value as it writes its cache with them. So a model whose attention
quantizers are anything else (one attention left out, keys and values quantized differently,
dynamic or fixed scales, a quantized query or probabilities, which the engines quantize with
their own kernels) is refused here, one line per reason, whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qtransform.export.checkpoint.collect import AttentionExport, Collected
from qtransform.formats import QuantConfig
from qtransform.passes import FakeQuantize

POINTS = ("key", "value")


@dataclass(frozen=True)
class KVCache:
    """The key/value quantization of every attention module of a model: one format, one scale
    per tensor or per head (`per_head`), static scales from `observer` (None: stored ones)."""

    config: QuantConfig
    per_head: bool
    observer: str | None
    modules: tuple[AttentionExport, ...]


def kv_cache(collected: Collected) -> tuple[KVCache | None, list[str]]:
    """The model's KV cache as one scheme (None when no attention is quantized), or the reasons
    no KV-cache scheme holds it."""
    quantized = [a for a in collected.attention.values() if a.points]
    if not quantized:
        return None, []
    refusals = []
    plain = [a.name for a in collected.attention.values() if not a.points]
    if plain:
        more = f" and {len(plain) - 1} more" if len(plain) > 1 else ""
        refusals.append(f"{plain[0]}{more} keep their KV cache in high precision while other "
                        "attention modules quantize theirs; a KV-cache scheme covers every "
                        "attention: quantize all or none")
    kinds = set()
    for a in quantized:
        extra = [p for p in a.points if p not in POINTS]
        if extra:
            refusals.append(f"{a.name}: its {' and '.join(extra)} is quantized; checkpoints hold "
                            "a KV-cache scheme (keys and values) only, engines quantize the query "
                            "and probabilities by their kernels (docs/attention.md): leave "
                            f"{' and '.join(extra)} out of the rules")
        missing = [p for p in POINTS if p not in a.points]
        if missing:
            refusals.append(f"{a.name}: its {missing[0]} is not quantized; a KV-cache scheme "
                            "quantizes keys and values alike")
        for point in POINTS:
            child = a.points.get(point)
            if child is None:
                continue
            first = child.quantizers()[0]
            static = first.static_scale
            kinds.add((first.config, not isinstance(child, FakeQuantize),  # one scale per head
                       None if static is None or static.stored else static.observer_name))
            reason = _scale_reason(child, first)
            if reason:
                refusals.append(f"{a.name} ({point}): {reason}")
    if len(kinds) > 1:
        refusals.append("the attention modules' keys and values are quantized in more than one "
                        "way; a KV-cache scheme is one format and one scale granularity: give "
                        "them one rule")
    if refusals:
        return None, refusals
    (config, per_head, observer), = kinds
    return KVCache(config, per_head, observer, tuple(quantized)), []


def _scale_reason(child: nn.Module, first: FakeQuantize) -> str | None:
    if first.global_scale == "fixed":
        return ("a fixed scale is what an engine uses when a checkpoint gives none; a checkpoint "
                "stores calibrated scales: set scale_source 'static' and calibrate")
    if first.global_scale != "static" or first.static_scale is None:
        return ("a KV-cache scheme stores static scales (engines quantize each key as they write "
                "the cache); set scale_source 'static' and calibrate")
    if not all(q.static_scale is not None and q.static_scale.frozen for q in child.quantizers()):
        return "its static scale is not calibrated; pass calibration=batches (CLI: --calib FILE)"
    return None


def model_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of an attention module's weights (the model's)."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
