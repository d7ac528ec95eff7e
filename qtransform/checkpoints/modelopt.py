"""ModelOpt's Hugging Face layout (`export_hf_checkpoint`, nvidia-modelopt 0.47), what vLLM and
TensorRT-LLM load as `quant_method: modelopt`: its vocabulary in one module, read and written.

`hf_quant_config.json` (`producer`, `quantization`: `quant_algo` "NVFP4" with `group_size` 16 or
"FP8", `kv_cache_quant_algo`, `exclude_modules`) and the same scheme in config.json's
`quantization_config`; per quantized Linear (`LAYOUTS`, one row per quant_algo):

| quant_algo | tensors |
|---|---|
| NVFP4 | `weight` (uint8, two E2M1 codes per byte, even column low), `weight_scale` (E4M3 per 16), `weight_scale_2` (fp32 0-dim, amax / 2688: the decode factor), `input_scale` (fp32 0-dim, static activations) |
| FP8 | `weight` (float8_e4m3fn), `weight_scale` (fp32 0-dim), `input_scale` (fp32 0-dim) |
| W4A16_NVFP4 | NVFP4's without `input_scale` (read: ModelOpt's name for NVFP4 weights with 16-bit inputs) |

ModelOpt decodes q * weight_scale (* weight_scale_2): NVFP4 weights in the orders whose decode is
q * (s * d) (`nvfp4_variant` "modelopt", its export's, or "default", NVIDIA's) and FP8 per tensor
are stored exactly; anything else is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qtransform.checkpoints.description import (
    Checkpoint,
    Group,
    KVScheme,
    Reason,
    Specs,
    TensorScheme,
    blockwise,
    need,
    scaled,
)
from qtransform.checkpoints.matching import modelopt_ignored_entries
from qtransform.checkpoints.packing import unpack_fp4
from qtransform.core.observers import StoredScale
from qtransform.errors import UserError
from qtransform.formats import QuantConfig

NAME = "modelopt"
FILE = "hf_quant_config.json"
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the ModelOpt release whose layout this writes
SCALES = {"weight_scale": False, "weight_scale_2": True, "input_scale": True}  # True: above zero
INPUT_SCALES = ("input_scale",)
SUFFIXES = tuple(SCALES)

@dataclass(frozen=True)
class Layout:
    """One quant_algo: its config group, stored tensors and decoding (a row of `LAYOUTS`)."""

    algo: str
    format: str  # the Group.format name the reader keeps
    weights: TensorScheme
    inputs: TensorScheme | None  # None: 16-bit inputs (no input_scale)
    specs: Callable[[int, int], Specs]  # rows, cols
    decode: Callable[[dict[str, Tensor], TensorScheme, str], Tensor]


def _decode_nvfp4(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    codes = unpack_fp4(need(p, "weight", where))
    scale = need(p, "weight_scale", where).to(torch.float32)
    per_block = scale * need(p, "weight_scale_2", where).to(torch.float32).reshape(())
    return blockwise(codes, per_block, 16, where)


def _decode_fp8(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    return scaled(need(p, "weight", where).to(torch.float32),
                  need(p, "weight_scale", where).to(torch.float32), None, w, where)


def _nvfp4_specs(rows: int, cols: int) -> Specs:
    return [("weight", torch.uint8, (rows, cols // 2)),
            ("weight_scale", torch.float8_e4m3fn, (rows, cols // 16)),
            ("weight_scale_2", torch.float32, ())]


LAYOUTS = {row.algo: row for row in (
    Layout("NVFP4", "modelopt-nvfp4", TensorScheme("float", 4, "tensor_group", 16),
           TensorScheme("float", 4, "tensor_group", 16, dynamic="local"), _nvfp4_specs, _decode_nvfp4),
    # ModelOpt's name for NVFP4 weights whose input quantizer is off (`get_quantization_format`)
    Layout("W4A16_NVFP4", "modelopt-nvfp4", TensorScheme("float", 4, "tensor_group", 16), None,
           _nvfp4_specs, _decode_nvfp4),
    Layout("FP8", "modelopt-fp8", TensorScheme("float", 8, "tensor"), TensorScheme("float", 8, "tensor"),
           lambda rows, cols: [("weight", torch.float8_e4m3fn, (rows, cols)),
                               ("weight_scale", torch.float32, ())],
           _decode_fp8),
)}
DECODERS = {row.format: row.decode for row in LAYOUTS.values()}


# --- reading --------------------------------------------------------------------------------------

def parse(file: Path, data: dict) -> Checkpoint:
    """The checkpoint hf_quant_config.json (or config.json's ModelOpt quantization_config)
    describes, or a refusal naming the field."""
    q = data.get("quantization", data)
    if not isinstance(q, dict):
        raise UserError(f"{file}: 'quantization' must be an object")
    algo = q.get("quant_algo")
    if algo not in LAYOUTS:
        raise UserError(f"{file}: ModelOpt quant_algo {algo!r}, which qtransform does not open "
                        f"(it reads {', '.join(LAYOUTS)})")
    kv_algo = q.get("kv_cache_quant_algo")
    if kv_algo and kv_algo not in KV_FIELDS:
        raise UserError(f"{file}: kv_cache_quant_algo {kv_algo!r}, which qtransform does not "
                        f"read (it reads {', '.join(KV_FIELDS)})")
    if algo in ("NVFP4", "W4A16_NVFP4") and q.get("group_size", 16) != 16:
        raise UserError(f"{file}: NVFP4 with group_size {q.get('group_size')}; only 16 is read")
    row = LAYOUTS[algo]
    group = Group(("Linear",), row.weights, row.inputs, row.format)
    kv = KVScheme(dict(KV_FIELDS[kv_algo]), f"{kv_algo} per tensor") if kv_algo else None
    return Checkpoint(NAME, [group], [str(m) for m in q.get("exclude_modules") or []], kv=kv)


def settle_inputs(checkpoint: Checkpoint, with_scale: list[str], without: list[str], where: str) -> None:
    """Keep a group's input scheme only where the checkpoint stores its input scales: ModelOpt
    writes `input_scale` for every Linear whose inputs are quantized and none when they are not
    (an FP8 or NVFP4 quant_algo names the weights either way), so inputs are 16-bit where no
    quantized Linear has one; some with and some without is refused."""
    if with_scale and without:
        raise UserError(f"{where}: input_scale on {with_scale[0]} but not on {without[0]}; ModelOpt "
                        "stores one for every Linear whose inputs are quantized: re-export it")
    if not with_scale:
        checkpoint.groups = [replace(g, inputs=None) for g in checkpoint.groups]


# the KV cache: `self_attn.k_proj.k_scale` / `v_proj.v_scale` = amax / 448 in fp32, 0-dim, for
# FP8 and NVFP4 caches alike (modelopt/torch/export/quant_utils.py); the quantizers run on the
# keys and values after RoPE, max-calibrated, FP8 as x * (448 / amax)
KV_SCALES = {"k_scale": "key", "v_scale": "value"}
KV_FIELDS: dict[str, dict[str, Any]] = {
    "FP8": {"format": "fp8_e4m3", "fp8_variant": NAME, "granularity": "tensor",
            "scale_source": "static", "observer": "static_minmax"},
    "NVFP4": {"format": "nvfp4", "nvfp4_variant": NAME, "scale_source": "static",
              "observer": "static_minmax"},
}
KV_AMAX = 448.0  # the stored KV scale is the keys' (values') amax over this, for both algos


def kv_owner(module: str) -> str:
    """The attention module whose key/value a `<module>.k_scale` scales: k_proj's parent."""
    return module.rpartition(".")[0]


def kv_value(fields: dict[str, Any], scale: Tensor) -> Tensor | StoredScale:
    """A stored key/value scale as the KV rule's static scale: FP8's is used as stored (x times
    fl(1 / scale), as engines use it); NVFP4's gives back the calibrated amax (scale * 448),
    from which the NVFP4 quantizer computes its own global scale."""
    return StoredScale(scale) if fields["format"] == "fp8_e4m3" else scale * KV_AMAX


def kv_algo(cfg: QuantConfig, per_head: bool, where: str) -> str | Reason:
    """The kv_cache_quant_algo of keys and values quantized with `cfg`, or why ModelOpt has none."""
    if per_head:
        return Reason(f"{where}: ModelOpt's KV caches have one scale per tensor; use granularity "
                      '"tensor"')
    for algo, fields in KV_FIELDS.items():
        if cfg.name == fields["format"] and (cfg.granularity == "tensor") == (algo == "FP8") and \
                cfg.options().get(f"{cfg.family.name}_variant", NAME) == NAME and cfg.rounding == "rne":
            return algo
    return Reason(f"{where}: ModelOpt's KV caches are FP8 per tensor or NVFP4 (its variant: "
                  "fp8_variant / nvfp4_variant 'modelopt', rounding 'rne')")


def kv_scale_name(attention: str, point: str) -> str:
    """Where ModelOpt stores the scale of an attention's keys or values."""
    suffix = next(k for k, v in KV_SCALES.items() if v == point)
    return f"{attention}.{'k_proj' if point == 'key' else 'v_proj'}.{suffix}"


def rule_fields(s: TensorScheme, tensor: str) -> dict[str, Any]:
    """The quantize-rule fields of one tensor scheme: what the ModelOpt presets write
    (schemas/presets/modelopt.py) for the config that saved it."""
    static = {"scale_source": "static", "observer": "static_minmax"}
    if s.bits == 4:
        out: dict[str, Any] = {"format": "nvfp4", "nvfp4_variant": NAME}
        if tensor == "weight":
            out["share_scale"] = "fused"
        else:
            out.update(static)
        return out
    out = {"format": "fp8_e4m3", "fp8_variant": NAME, "granularity": "tensor"}
    return out if tensor == "weight" else {**out, **static}


# --- writing --------------------------------------------------------------------------------------

def weight_algo(cfg: QuantConfig, cols: int, where: str) -> str | Reason:
    """The quant_algo of a weight quantized with `cfg`, or why ModelOpt has none."""
    if cfg.family.name == "nvfp4":
        if cfg.nvfp4_variant not in ("modelopt", "default"):
            return Reason(f"{where}: nvfp4_variant {cfg.nvfp4_variant!r} decodes as q * s / g, ModelOpt as "
                          "q * s * d; use nvfp4_variant 'modelopt' (format='compressed-tensors' takes "
                          "'compressed-tensors')")
        if cfg.tile or cfg.block_axis not in (-1, 1) or cols % 16:
            return Reason(f"{where}: ModelOpt's NVFP4 is 1x16 blocks along rows of a multiple of 16")
        return "NVFP4"
    if cfg.name == "fp8_e4m3":
        if cfg.granularity != "tensor":
            return Reason(f"{where}: ModelOpt's FP8 here is one scale per tensor; granularity "
                          f"{cfg.granularity!r} has no field in it")
        return "FP8"
    return Reason(f"{where}: format {cfg.name} has no ModelOpt form here (NVFP4 and FP8 per tensor)")


def input_reason(cfg: QuantConfig, algo: str, static: bool, calibrated: bool, where: str) -> Reason | None:
    """Why activations quantized with `cfg` do not fit a ModelOpt `algo` checkpoint, or None."""
    want = "nvfp4" if algo == "NVFP4" else "fp8_e4m3"
    if cfg.name != want or (algo == "FP8" and cfg.granularity != "tensor"):
        return Reason(f"{where}: ModelOpt's {algo} checkpoints quantize inputs as {algo} per tensor")
    if not static:
        return Reason(f"{where}: ModelOpt stores one calibrated input_scale; set scale_source 'static'")
    if not calibrated:
        return Reason(f"{where}: its static scale is not calibrated; pass calibration=batches "
                      "(CLI: --calib FILE)")
    if cfg.rounding != "rne":
        return Reason(f"{where}: rounding {cfg.rounding!r}; engines round activations to nearest even")
    return None


def quant_config(algo: str, inputs: bool, excluded: list[str],
                 kv: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json's quantization_config) of a checkpoint of one
    quant_algo (and `kv`, a kv_cache_quant_algo), as ModelOpt's export writes them."""
    quantization: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": kv}
    if algo == "NVFP4":
        quantization["group_size"] = 16
    quantization["exclude_modules"] = excluded
    args: dict[str, Any] = {"dynamic": False, "num_bits": 4 if algo == "NVFP4" else 8, "type": "float"}
    if algo == "NVFP4":
        args["group_size"] = 16
    group = {"input_activations": dict(args) if inputs else None, "weights": dict(args),
             "targets": ["Linear"]}
    config = {"config_groups": {"group_0": group}, "ignore": excluded, "quant_algo": algo,
              "producer": dict(PRODUCER), "quant_method": NAME}
    if kv is not None:  # convert_hf_config.py: FP8 as QuantizationArgs, other algos by name
        config["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"} if kv == "FP8" else kv
    return {"producer": dict(PRODUCER), "quantization": quantization}, config


# --- the policy of an opened checkpoint -----------------------------------------------------------

CALIBRATION = None  # ModelOpt's max calibration runs the model as it is


def ignored_entries(ignore: list[str], names: list[str]) -> list[str]:
    """`exclude_modules` as qtransform entries on a model with modules `names`."""
    return modelopt_ignored_entries(ignore, names)
