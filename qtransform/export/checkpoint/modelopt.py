"""The ModelOpt writer: the collected Linears mapped to a quant_algo
(`qtransform.checkpoints.modelopt`: its configs and layouts) and their stored numbers
(`formats.stored`, the one encoder) laid out in the layout's tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.checkpoints import modelopt as mo
from qtransform.checkpoints.description import Reason
from qtransform.checkpoints.packing import e2m1_codes, pack_nibbles
from qtransform.core.observers import StaticScale
from qtransform.export.checkpoint.collect import Collected, LinearExport, fused_sets
from qtransform.export.checkpoint.kv import POINTS, KVCache
from qtransform.export.checkpoint.source import source_input_scale, source_weight
from qtransform.export.checkpoint.writer import Entry, Spec
from qtransform.formats.stored import fp4_stored, weight_chunks

NAME = mo.NAME
ROTATIONS = False  # hf_quant_config.json has no field for an online rotation
KV_ONLY = False  # hf_quant_config.json here always names a quant_algo


@dataclass(frozen=True)
class Scheme:
    """One Linear's quant_algo and whether it has a static input scale."""

    algo: str  # a key of `mo.LAYOUTS`
    inputs: bool


def schemes(collected: Collected) -> tuple[dict[str, Scheme], list[str]]:
    """Each quantized Linear's scheme, and the reasons some have none."""
    out: dict[str, Scheme] = {}
    refusals: list[str] = []
    for name, entry in collected.linears.items():
        if entry.rotation is not None:
            refusals.append(f"{name} is rotated (the rotate pass), and ModelOpt's hf_quant_config.json has "
                            "no field for an online rotation; export format='compressed-tensors' "
                            "(its transform_config) or transform without the rotation")
            continue
        if not entry.quantized:
            continue
        if entry.weight is None:
            refusals.append(f"{name}: its input is quantized and its weight is not; ModelOpt "
                            "checkpoints quantize the weight of every quantized Linear")
            continue
        algo = mo.weight_algo(entry.weight.config, entry.module.weight.shape[-1], f"{name} (weight)")
        if isinstance(algo, Reason):
            refusals.append(algo.text)
            continue
        fq = entry.input
        bad = None if fq is None else mo.input_reason(
            fq.config, algo, fq.global_scale == "static",
            isinstance(fq.static_scale, StaticScale) and fq.static_scale.frozen, f"{name} (input)")
        if bad is not None:
            refusals.append(bad.text)
            continue
        out[name] = Scheme(algo, fq is not None)
    algos = sorted({s.algo for s in out.values()})
    if len(algos) > 1:
        refusals.append(f"the model mixes {' and '.join(algos)}; a ModelOpt checkpoint written here "
                        "has one quant_algo")
    if len({s.inputs for s in out.values()}) > 1:
        refusals.append("some quantized Linears have static input scales and some none; ModelOpt's "
                        "quant_algo covers weights and inputs alike")
    for parent, members in fused_sets(collected.linears):
        if all(out.get(m.name) and mo.LAYOUTS[out[m.name].algo].weights.bits == 4 for m in members):
            groups = {id(m.weight.group) if m.weight is not None and m.weight.group is not None
                      else id(m) for m in members}
            if len(groups) > 1:
                refusals.append(f"{parent}: {'/'.join(m.name.rpartition('.')[2] for m in members)} have "
                                "their own NVFP4 global scales, but engines run them as one Linear "
                                "with one weight_scale_2; set share_scale 'fused'")
    return out, refusals


def excluded(collected: Collected, found: dict[str, Scheme]) -> list[str]:
    """The Linears left in high precision, and the embeddings (ModelOpt lists both)."""
    names = [name for name in collected.linears if name not in found]
    return sorted({*names, *collected.embeddings})


def _configs(collected: Collected, found: dict[str, Scheme],
             kv: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    scheme = next(iter(found.values()))
    return mo.quant_config(scheme.algo, scheme.inputs, excluded(collected, found), kv)


def hf_quant_config(collected: Collected, found: dict[str, Scheme], kv: str | None) -> dict[str, Any]:
    """hf_quant_config.json, as ModelOpt's export writes it."""
    return _configs(collected, found, kv)[0]


def quantization_config(collected: Collected, found: dict[str, Scheme], kv: str | None,
                        transform_config: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's `quantization_config`: ModelOpt's own conversion of hf_quant_config."""
    if transform_config:
        raise AssertionError("ModelOpt checkpoints carry no transform_config")
    return _configs(collected, found, kv)[1]


def write_extra(folder: Path, collected: Collected, found: dict[str, Scheme], kv: str | None) -> None:
    (folder / mo.FILE).write_text(json.dumps(hf_quant_config(collected, found, kv), indent=4))


def kv_cache(kv: KVCache) -> tuple[str | None, list[str]]:
    """The kv_cache_quant_algo of the model's keys and values."""
    algo = mo.kv_algo(kv.config, kv.per_head, "keys and values")
    return (None, [algo.text]) if isinstance(algo, Reason) else (algo, [])


def kv_entries(kv: KVCache, algo: str) -> list[Entry]:
    """Each attention's `k_proj.k_scale` and `v_proj.v_scale`: amax / 448 in fp32, 0-dim
    (ModelOpt's export, for FP8 and NVFP4 caches alike)."""
    del algo
    entries = []
    for attention in kv.modules:
        for point in POINTS:
            name = mo.kv_scale_name(attention.name, point)
            entries.append(Entry((Spec(name, torch.float32, ()),),
                                 lambda child=attention.points[point], name=name: {name: _kv_scale(child)}))
    return entries


def _kv_scale(child: nn.Module) -> Tensor:
    """amax / 448 in fp32 (an opened FP8 checkpoint's k_scale as stored)."""
    static = child.static_scale
    assert static is not None and static.frozen
    if static.stored:
        return static.scale.to(torch.float32).reshape(())
    return (static.amax.to(torch.float32) / mo.KV_AMAX).reshape(())


def linear_entry(entry: LinearExport, scheme: Scheme) -> Entry:
    """The tensors of one quantized Linear."""
    rows, cols = entry.module.weight.shape
    prefix = entry.name + "."
    specs = [Spec(prefix + suffix, dtype, shape) for suffix, dtype, shape in mo.LAYOUTS[scheme.algo].specs(rows, cols)]
    if scheme.inputs:
        specs.append(Spec(prefix + "input_scale", torch.float32, ()))
    return Entry(tuple(specs), lambda: _tensors(entry, scheme, specs))


def _tensors(entry: LinearExport, scheme: Scheme, specs: list[Spec]) -> dict[str, Tensor]:
    fq = entry.weight
    assert fq is not None
    weight = source_weight(entry)
    out = {s.name.rpartition(".")[2]: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    cfg = fq.config
    amax = fq.amax_for(weight)
    fp4 = mo.LAYOUTS[scheme.algo].weights.bits == 4
    stored = fp4_stored(weight, cfg, amax) if fp4 else None
    if stored is not None:
        out["weight"], out["weight_scale"], d = stored
        assert d is not None
        out["weight_scale_2"].fill_(d)
    for chunk in () if stored is not None else weight_chunks(weight, cfg, amax):
        rows = slice(chunk.start, chunk.start + chunk.elements.shape[0])
        if fp4:
            # ModelOpt's sign bit is the input's (`weight < 0`), so a negative value rounded to
            # zero is stored as -0 (code 8) although it decodes to +0
            codes = e2m1_codes(chunk.elements.abs())
            codes |= (weight[rows] < 0).to(torch.uint8) << 3
            out["weight"][rows] = pack_nibbles(codes)
            out["weight_scale"][rows] = chunk.scales.to(torch.float8_e4m3fn)
            assert chunk.tensor_scale is not None
            out["weight_scale_2"].fill_(chunk.tensor_scale)
        else:
            out["weight"][rows] = chunk.elements.to(torch.float8_e4m3fn)
            out["weight_scale"].fill_(chunk.scales.reshape(-1)[0])
    fq_in = entry.input
    if fq_in is not None and fq_in.static_scale is not None:
        scale, tensor_scale = source_input_scale(entry)
        out["input_scale"].fill_(tensor_scale if fp4 else scale)
    return {entry.name + "." + suffix: t for suffix, t in out.items()}
