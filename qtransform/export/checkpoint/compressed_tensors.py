"""The compressed-tensors writer: the collected Linears mapped to the format's schemes
(`qtransform.checkpoints.compressed_tensors`: its QuantizationArgs and layouts) and their stored
numbers (`formats.stored`, the one encoder) laid out in the layout's tensors.

Weights store any deterministic quantization whose decoding (elements times the stored scale,
NVFP4's over its global scale) is what the fake-quant computed; activations are quantized by the
engine at run time with compressed-tensors' own rules, so an activation scheme is written only
where qtransform's numerics are those rules, and refused otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qtransform.checkpoints import compressed_tensors as ct
from qtransform.checkpoints.description import Reason
from qtransform.checkpoints.packing import e2m1_codes, pack_int32, pack_nibbles
from qtransform.core.observers import StaticScale
from qtransform.export.checkpoint.collect import Collected, LinearExport, fused_sets
from qtransform.export.checkpoint.kv import POINTS, KVCache, model_dtype
from qtransform.export.checkpoint.source import source_input_scale, source_weight
from qtransform.export.checkpoint.writer import Entry, Spec
from qtransform.formats import QuantConfig
from qtransform.formats.stored import Chunk, fp4_stored, weight_chunks

NAME = ct.NAME
ROTATIONS = True  # transform_config carries online rotations
KV_ONLY = True  # a kv_cache_scheme with no config group (format "dense")


@dataclass(frozen=True)
class Scheme:
    """One config group: its layout and the two QuantizationArgs (as sorted JSON, hashable)."""

    layout: ct.Layout
    weights: str
    inputs: str | None

    def group(self, targets: list[str]) -> dict[str, Any]:
        return {"format": self.layout.format,
                "input_activations": None if self.inputs is None else json.loads(self.inputs),
                "output_activations": None, "targets": targets, "weights": json.loads(self.weights)}


def schemes(collected: Collected) -> tuple[dict[str, Scheme], list[str]]:
    """Each quantized Linear's scheme, and the reasons some have none."""
    out: dict[str, Scheme] = {}
    refusals: list[str] = []
    for name, entry in collected.linears.items():
        if not entry.quantized:
            continue
        if entry.weight is None:
            refusals.append(f"{name}: its input is quantized and its weight is not; "
                            "compressed-tensors checkpoints quantize the weight of every quantized Linear")
            continue
        w = ct.weight_args(entry.weight.config, entry.module.weight.shape[-1], entry.input is not None,
                           f"{name} (weight)")
        x = None
        if entry.input is not None:
            static = entry.input.static_scale
            x = ct.input_args(entry.input.config, entry.module.weight.dtype,
                              entry.input.global_scale == "static",
                              static.observer_name if static is not None else None, f"{name} (input)")
        bad = [r.text for r in (w, x) if isinstance(r, Reason)]
        if bad:
            refusals.extend(bad)
            continue
        assert not isinstance(w, Reason) and not isinstance(x, Reason)
        static = entry.input.static_scale if entry.input is not None else None
        if isinstance(static, StaticScale) and not static.frozen:
            refusals.append(f"{name} (input): its static scale is not calibrated; pass "
                            "calibration=batches (CLI: --calib FILE)")
            continue
        out[name] = Scheme(ct.layout_of(w[1], x is not None), w[0], x)
    refusals += _nvfp4_fusion(collected, out)
    return out, refusals


def _nvfp4_fusion(collected: Collected, found: dict[str, Scheme]) -> list[str]:
    """vLLM runs q/k/v and gate/up as one Linear with one NVFP4 global scale (vllm#41045)."""
    refusals = []
    for parent, members in fused_sets(collected.linears):
        if not all(found.get(m.name) and found[m.name].layout.kind == "nvfp4" for m in members):
            continue
        groups = {id(m.weight.group) if m.weight and m.weight.group is not None else id(m) for m in members}
        if len(groups) > 1:
            names = "/".join(m.name.rpartition(".")[2] for m in members)
            refusals.append(f"{parent}: {names} have their own NVFP4 global scales, but engines "
                            "run them as one Linear with one global scale; set share_scale 'fused'")
    return refusals


def kv_cache(kv: KVCache) -> tuple[str | None, list[str]]:
    """The kv_cache_scheme (QuantizationArgs as sorted JSON) of the model's keys and values."""
    args = ct.kv_args(kv.config, model_dtype(kv.modules[0].module), kv.per_head, kv.observer,
                      "keys and values")
    return (None, [args.text]) if isinstance(args, Reason) else (args, [])


def kv_entries(kv: KVCache, scheme: str) -> list[Entry]:
    """Each attention's `k_scale` and `v_scale`: [1], or [heads, 1, 1] per head, in the model's
    dtype, as compressed-tensors computes them from the calibrated amax."""
    del scheme
    entries = []
    for attention in kv.modules:
        dtype = model_dtype(attention.module)
        for point in POINTS:
            child = attention.points[point]
            heads = len(child.heads) if kv.per_head else None
            suffix, sdt, shape = ct.kv_scale_spec(point, dtype, heads)
            name = f"{attention.name}.{suffix}"
            entries.append(Entry((Spec(name, sdt, shape),), lambda child=child, name=name, sdt=sdt, shape=shape, dtype=dtype: {
                name: child.stored_scale(dtype).to(sdt).reshape(shape)}))
    return entries


def quantization_config(collected: Collected, found: dict[str, Scheme], kv: str | None,
                        transform_config: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's `quantization_config`, as compressed-tensors' `update_config` writes it."""
    groups: dict[Scheme, list[str]] = {}
    for name, scheme in found.items():
        groups.setdefault(scheme, []).append(name)
    every_linear = len(groups) == 1
    config_groups = {f"group_{i}": scheme.group(["Linear"] if every_linear else names)
                     for i, (scheme, names) in enumerate(groups.items())}
    formats = {s.layout.format for s in groups}
    return {
        "config_groups": config_groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision" if formats else "dense",
        "global_compression_ratio": None,
        "ignore": [name for name, e in collected.linears.items() if name not in found],
        "kv_cache_scheme": None if kv is None else json.loads(kv),
        "quant_method": NAME,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": transform_config or {},
        "version": ct.LAYOUT_VERSION,
    }


def write_extra(folder: Path, collected: Collected, found: dict[str, Scheme], kv: str | None) -> None:
    """compressed-tensors keeps everything in config.json: nothing more to write."""
    del folder, collected, found, kv


def linear_entry(entry: LinearExport, scheme: Scheme) -> Entry:
    """The tensors of one quantized Linear (its weight's replacement and its input scales)."""
    fq = entry.weight
    assert fq is not None
    rows, cols = entry.module.weight.shape
    dtype = entry.module.weight.dtype
    prefix = entry.name + "."
    specs = [Spec(prefix + suffix, sdt, shape)
             for suffix, sdt, shape in scheme.layout.specs(rows, cols, fq.config, dtype)]
    if entry.input is not None and entry.input.static_scale is not None:
        suffix, sdt, shape = ct.input_scale_spec(entry.input.config, dtype)
        specs.append(Spec(prefix + suffix, sdt, shape))
    return Entry(tuple(specs), lambda: _tensors(entry, scheme, specs))


def _tensors(entry: LinearExport, scheme: Scheme, specs: list[Spec]) -> dict[str, Tensor]:
    fq = entry.weight
    assert fq is not None
    weight = source_weight(entry)
    out = {s.name.rpartition(".")[2]: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    amax = fq.amax_for(weight)
    cfg = fq.config
    kind = scheme.layout.kind
    stored = fp4_stored(weight, cfg, amax) if kind in ("nvfp4", "mxfp4") else None
    if stored is not None:
        out["weight_packed"], out["weight_scale"], g = stored
        if g is not None:
            out["weight_global_scale"][0] = g
    for chunk in () if stored is not None else weight_chunks(weight, cfg, amax):
        _put(out, chunk, cfg, kind)
    if kind == "int-packed":
        out["weight_shape"] = torch.tensor(list(weight.shape), dtype=torch.int64)
    fq_in = entry.input
    if fq_in is not None and fq_in.static_scale is not None:
        scale, tensor_scale = source_input_scale(entry)
        if "input_global_scale" in out:
            assert tensor_scale is not None
            out["input_global_scale"][0] = tensor_scale
        else:
            out["input_scale"][0] = scale.to(out["input_scale"].dtype)
    return {entry.name + "." + suffix: t for suffix, t in out.items()}


def _put(out: dict[str, Tensor], chunk: Chunk, cfg: QuantConfig, kind: str) -> None:
    """One chunk of rows of the stored numbers, laid out in the layout's tensors."""
    rows = slice(chunk.start, chunk.start + chunk.elements.shape[0])
    if kind in ("nvfp4", "mxfp4"):
        out["weight_packed"][rows] = pack_nibbles(e2m1_codes(chunk.elements))
        out["weight_scale"][rows] = chunk.scales if kind == "mxfp4" else chunk.scales.to(torch.float8_e4m3fn)
        if chunk.tensor_scale is not None:
            out["weight_global_scale"][0] = chunk.tensor_scale
        return
    if kind == "int-packed":
        bits = 4 if cfg.name == "int4" else 8
        out["weight_packed"][rows] = pack_int32(chunk.elements.to(torch.int8), bits)
    else:
        out["weight"][rows] = chunk.elements.to(out["weight"].dtype)
    target, scales = out["weight_scale"], chunk.scales.to(out["weight_scale"].dtype)
    if cfg.granularity == "tensor":
        target[0] = scales.reshape(-1)[0]
    elif cfg.tile:
        start = chunk.start // cfg.tile[0]
        target[start:start + scales.shape[0]] = scales
    else:
        target[rows] = scales.reshape(target[rows].shape)
