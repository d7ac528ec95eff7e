"""ModelOpt's Hugging Face layout (`export_hf_checkpoint`, nvidia-modelopt 0.47), NVFP4 and FP8,
what vLLM and TensorRT-LLM load as `quant_method: modelopt`.

`hf_quant_config.json` (`producer`, `quantization`: `quant_algo` "NVFP4" with `group_size` 16 or
"FP8", `kv_cache_quant_algo` null, `exclude_modules`) and the same scheme in config.json's
`quantization_config`; per quantized Linear:

| quant_algo | tensors |
|---|---|
| NVFP4 | `weight` (uint8, two E2M1 codes per byte, even column low), `weight_scale` (E4M3 per 16), `weight_scale_2` (fp32 0-dim, amax / 2688: the decode factor), `input_scale` (fp32 0-dim, static activations) |
| FP8 | `weight` (float8_e4m3fn), `weight_scale` (fp32 0-dim), `input_scale` (fp32 0-dim) |

ModelOpt decodes q * weight_scale (* weight_scale_2): NVFP4 weights in the orders whose decode
is q * (s * d) (`nvfp4_variant` "modelopt", its export's, or "default", NVIDIA's) and FP8 per
tensor are stored exactly; anything else is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qtransform.core.observers import StaticScale
from qtransform.export.checkpoint.collect import Collected, LinearExport, Reason, fused_sets
from qtransform.export.checkpoint.packing import e2m1_codes, pack_nibbles
from qtransform.export.checkpoint.source import source_weight
from qtransform.export.checkpoint.tensors import fp4_stored, input_scale_of, weight_chunks
from qtransform.export.checkpoint.writer import Entry, Spec
from qtransform.passes import FakeQuantize

NAME = "modelopt"
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the ModelOpt release whose layout this writes


@dataclass(frozen=True)
class Scheme:
    """One Linear's quant_algo and whether it has a static input scale."""

    algo: str  # "NVFP4" | "FP8"
    inputs: bool


def _weight(fq: FakeQuantize, entry: LinearExport) -> str | Reason:
    cfg = fq.config
    where = f"{entry.name} (weight)"
    if cfg.family.name == "nvfp4":
        if cfg.nvfp4_variant not in ("modelopt", "default"):
            return Reason(f"{where}: nvfp4_variant {cfg.nvfp4_variant!r} decodes as q * s / g, ModelOpt as "
                          "q * s * d; use nvfp4_variant 'modelopt' (format='compressed-tensors' takes "
                          "'compressed-tensors')")
        if cfg.tile or cfg.block_axis not in (-1, 1) or entry.module.weight.shape[-1] % 16:
            return Reason(f"{where}: ModelOpt's NVFP4 is 1x16 blocks along rows of a multiple of 16")
        return "NVFP4"
    if cfg.name == "fp8_e4m3":
        if cfg.granularity != "tensor":
            return Reason(f"{where}: ModelOpt's FP8 here is one scale per tensor; granularity "
                          f"{cfg.granularity!r} has no field in it")
        return "FP8"
    return Reason(f"{where}: format {cfg.name} has no ModelOpt form here (NVFP4 and FP8 per tensor)")


def _input(fq: FakeQuantize, entry: LinearExport, algo: str) -> Reason | None:
    cfg = fq.config
    where = f"{entry.name} (input)"
    want = "nvfp4" if algo == "NVFP4" else "fp8_e4m3"
    if cfg.name != want or (algo == "FP8" and cfg.granularity != "tensor"):
        return Reason(f"{where}: ModelOpt's {algo} checkpoints quantize inputs as {algo} per tensor")
    if fq.global_scale != "static":
        return Reason(f"{where}: ModelOpt stores one calibrated input_scale; set scale_source 'static'")
    if not isinstance(fq.static_scale, StaticScale) or not fq.static_scale.frozen:
        return Reason(f"{where}: its static scale is not calibrated; pass calibration=batches "
                      "(CLI: --calib FILE)")
    if cfg.rounding != "rne":
        return Reason(f"{where}: rounding {cfg.rounding!r}; engines round activations to nearest even")
    return None


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
        algo = _weight(entry.weight, entry)
        if isinstance(algo, Reason):
            refusals.append(algo.text)
            continue
        bad = None if entry.input is None else _input(entry.input, entry, algo)
        if bad is not None:
            refusals.append(bad.text)
            continue
        out[name] = Scheme(algo, entry.input is not None)
    algos = sorted({s.algo for s in out.values()})
    if len(algos) > 1:
        refusals.append(f"the model mixes {' and '.join(algos)}; a ModelOpt checkpoint written here "
                        "has one quant_algo")
    inputs = {s.inputs for s in out.values()}
    if len(inputs) > 1:
        refusals.append("some quantized Linears have static input scales and some none; ModelOpt's "
                        "quant_algo covers weights and inputs alike")
    for parent, members in fused_sets(collected.linears):
        if all(out.get(m.name) and out[m.name].algo == "NVFP4" for m in members):
            groups = {id(m.weight.group) if m.weight is not None and m.weight.group is not None
                      else id(m) for m in members}
            if len(groups) > 1:
                refusals.append(f"{parent}: {'/'.join(m.name.rpartition('.')[2] for m in members)} have "
                                "their own NVFP4 global scales, but engines run them as one Linear "
                                "with one weight_scale_2; set share_scale 'fused'")
    return out, refusals


def hf_quant_config(collected: Collected, found: dict[str, Scheme]) -> dict[str, Any]:
    """hf_quant_config.json, as ModelOpt's export writes it."""
    algo = next(iter(found.values())).algo
    quantization: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if algo == "NVFP4":
        quantization["group_size"] = 16
    quantization["exclude_modules"] = collected_excludes(collected, found)
    return {"producer": dict(PRODUCER), "quantization": quantization}


def collected_excludes(collected: Collected, found: dict[str, Scheme]) -> list[str]:
    """The Linears left in high precision, and the embeddings (ModelOpt lists both)."""
    names = [name for name in collected.linears if name not in found]
    return sorted({*names, *collected.embeddings})


def quantization_config(collected: Collected, found: dict[str, Scheme],
                        transform_config: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's `quantization_config`: ModelOpt's own conversion of hf_quant_config."""
    if transform_config:
        raise AssertionError("ModelOpt checkpoints carry no transform_config")
    scheme = next(iter(found.values()))
    args: dict[str, Any] = {"dynamic": False, "num_bits": 4 if scheme.algo == "NVFP4" else 8, "type": "float"}
    if scheme.algo == "NVFP4":
        args["group_size"] = 16
    group = {"input_activations": dict(args) if scheme.inputs else None, "weights": dict(args),
             "targets": ["Linear"]}
    return {"config_groups": {"group_0": group}, "ignore": collected_excludes(collected, found),
            "quant_algo": scheme.algo, "producer": dict(PRODUCER), "quant_method": "modelopt"}


def write_extra(folder: Path, collected: Collected, found: dict[str, Scheme]) -> None:
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(collected, found), indent=4))


def linear_entry(entry: LinearExport, scheme: Scheme) -> Entry:
    """The tensors of one quantized Linear."""
    rows, cols = entry.module.weight.shape
    prefix = entry.name + "."
    if scheme.algo == "NVFP4":
        specs = [Spec(prefix + "weight", torch.uint8, (rows, cols // 2)),
                 Spec(prefix + "weight_scale", torch.float8_e4m3fn, (rows, cols // 16)),
                 Spec(prefix + "weight_scale_2", torch.float32, ())]
    else:
        specs = [Spec(prefix + "weight", torch.float8_e4m3fn, (rows, cols)),
                 Spec(prefix + "weight_scale", torch.float32, ())]
    if scheme.inputs:
        specs.append(Spec(prefix + "input_scale", torch.float32, ()))
    return Entry(tuple(specs), lambda: _tensors(entry, scheme, specs))


def _tensors(entry: LinearExport, scheme: Scheme, specs: list[Spec]) -> dict[str, Tensor]:
    fq = entry.weight
    assert fq is not None
    weight = source_weight(entry)
    out = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    prefix = entry.name + "."
    cfg = fq.config
    amax = fq.amax_for(weight)
    stored = fp4_stored(weight, cfg, amax) if scheme.algo == "NVFP4" else None
    if stored is not None:
        out[prefix + "weight"], out[prefix + "weight_scale"], d = stored
        assert d is not None
        out[prefix + "weight_scale_2"].fill_(d)
    for chunk in () if stored is not None else weight_chunks(weight, cfg, amax):
        rows = slice(chunk.start, chunk.start + chunk.elements.shape[0])
        if scheme.algo == "NVFP4":
            # ModelOpt's sign bit is the input's (`weight < 0`), so a negative value rounded to
            # zero is stored as -0 (code 8) although it decodes to +0
            codes = e2m1_codes(chunk.elements.abs())
            codes |= (weight[rows] < 0).to(torch.uint8) << 3
            out[prefix + "weight"][rows] = pack_nibbles(codes)
            out[prefix + "weight_scale"][rows] = chunk.scales.to(torch.float8_e4m3fn)
            assert chunk.tensor_scale is not None
            out[prefix + "weight_scale_2"].fill_(chunk.tensor_scale)
        else:
            out[prefix + "weight"][rows] = chunk.elements.to(torch.float8_e4m3fn)
            out[prefix + "weight_scale"].fill_(chunk.scales.reshape(-1)[0])
    fq_in = entry.input
    if fq_in is not None and fq_in.static_scale is not None:
        scale, tensor_scale = input_scale_of(fq_in.config, fq_in.static_scale, entry.module.weight.dtype)
        out[prefix + "input_scale"].fill_(tensor_scale if scheme.algo == "NVFP4" else scale)
    return out

