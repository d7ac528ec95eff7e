"""compressed-tensors, the layout llm-compressor's `save_compressed` writes and vLLM and
transformers load (compressed-tensors 0.19): its vocabulary in one module, read and written.

- the names: `quant_method`, the compressors' formats, the stored tensors of each;
- the layouts (`LAYOUTS`, one row per compressor format): which tensors a quantized Linear holds,
  with their dtypes and shapes, and how they decode (the product in fp32, rounded once to the
  model's dtype, as the library decompresses);
- the mapping between its QuantizationArgs and qtransform's quantize rules, both ways:
  `parse` / `rule_fields` (a checkpoint's config as a policy) and `weight_args` / `input_args`
  (a fake-quant's options as QuantizationArgs, or why the format has none).

| format | tensors |
|---|---|
| `nvfp4-pack-quantized` | `weight_packed` (uint8, two E2M1 codes per byte), `weight_scale` (E4M3 per 16), `weight_global_scale` (fp32 [1], 2688/amax), `input_global_scale` (fp32 [1], static activations) |
| `mxfp4-pack-quantized` | `weight_packed`, `weight_scale` (uint8 E8M0 exponent + 127 per 32) |
| `float-quantized` / `naive-quantized` (FP8) | `weight` (float8_e4m3fn), `weight_scale` (per tensor [1], channel [out, 1], block tiles, groups), `input_scale` (static activations) |
| `int-quantized` (int weights with int activations) | `weight` (int8), `weight_scale`, `input_scale` (static) |
| `pack-quantized` (int weights alone) | `weight_packed` (int32, dense bits), `weight_scale`, `weight_shape` (int64 [2]), optional packed `weight_zero_point` |
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
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
from qtransform.checkpoints.matching import ct_ignored_entries
from qtransform.checkpoints.packing import e8m0_values, unpack_fp4, unpack_int32
from qtransform.checkpoints.rotations import parse as parse_rotations
from qtransform.core.observers import StoredScale
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.formats.stored import stored_scale_dtype

NAME = "compressed-tensors"
FILE = None  # no file of its own: config.json's quantization_config says it all
LAYOUT_VERSION = "0.19.0"  # the compressed-tensors release whose layout this reads and writes
WEIGHT_OBSERVER = "memoryless_minmax"  # what llm-compressor records for every weight
STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token")
_GRANULARITY = {"block": "group", "channel": "channel", "token": "channel", "tensor": "tensor"}

@dataclass(frozen=True)
class Layout:
    """One compressor format: how a quantized Linear's weight is stored (a row of `LAYOUTS`)."""

    format: str
    kind: str  # the stored numbers: nvfp4, mxfp4, fp8, int (one element per tensor entry), int-packed
    specs: Callable[[int, int, QuantConfig, torch.dtype], Specs]  # rows, cols, weight options, model dtype
    decode: Callable[[dict[str, Tensor], TensorScheme, str], Tensor]  # stored tensors -> fp32 weight


def _fp4_specs(block: int, scale: torch.dtype, global_scale: bool) -> Callable[..., Specs]:
    def specs(rows: int, cols: int, cfg: QuantConfig, dtype: torch.dtype) -> Specs:
        out = [("weight_packed", torch.uint8, (rows, cols // 2)), ("weight_scale", scale, (rows, cols // block))]
        return out + ([("weight_global_scale", torch.float32, (1,))] if global_scale else [])
    return specs


def scale_shape(cfg: QuantConfig, rows: int, cols: int) -> tuple[int, ...]:
    """The stored weight_scale's shape of a plain-scale (FP8, int) weight of `cfg`."""
    if cfg.tile:
        return (math.ceil(rows / cfg.tile[0]), math.ceil(cols / cfg.tile[1]))
    if cfg.granularity == "tensor":
        return (1,)
    if cfg.granularity in ("channel", "token"):
        return (rows, 1)
    return (rows, math.ceil(cols / cfg.block))


def _plain_specs(element: torch.dtype) -> Callable[..., Specs]:
    def specs(rows: int, cols: int, cfg: QuantConfig, dtype: torch.dtype) -> Specs:
        return [("weight", element, (rows, cols)),
                ("weight_scale", stored_scale_dtype(cfg, dtype), scale_shape(cfg, rows, cols))]
    return specs


def _packed_int_specs(rows: int, cols: int, cfg: QuantConfig, dtype: torch.dtype) -> Specs:
    bits = 4 if cfg.name == "int4" else 8
    return [("weight_packed", torch.int32, (rows, math.ceil(cols * bits / 32))),
            ("weight_scale", stored_scale_dtype(cfg, dtype), scale_shape(cfg, rows, cols)),
            ("weight_shape", torch.int64, (2,))]


def _decode_nvfp4(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    """code * (scale / g): the E4M3 scale in bf16 (the library's order), the fp32 global scale."""
    codes = unpack_fp4(need(p, "weight_packed", where))
    g = need(p, "weight_global_scale", where).to(torch.float32).reshape(())
    scale = need(p, "weight_scale", where).to(torch.bfloat16).to(torch.float32) / g
    return blockwise(codes, scale, 16, where)


def _decode_mxfp4(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    codes = unpack_fp4(need(p, "weight_packed", where))
    scale = e8m0_values(need(p, "weight_scale", where)).to(torch.bfloat16)
    return blockwise(codes, scale.to(torch.float32), w.group_size or 32, where)


def _decode_packed_int(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    scale = need(p, "weight_scale", where)
    shape = [int(v) for v in need(p, "weight_shape", where).tolist()]
    q = unpack_int32(need(p, "weight_packed", where), w.bits, shape[-1])
    zp = p.get("weight_zero_point")
    if zp is not None and zp.dtype == torch.int32:  # packed along the output axis
        zp = unpack_int32(zp.t().contiguous(), w.bits, shape[0]).t()
    return scaled(q.to(torch.float32), scale, zp, w, where).to(scale.dtype)


def _decode_plain(p: dict[str, Tensor], w: TensorScheme, where: str) -> Tensor:
    scale = need(p, "weight_scale", where)
    q = need(p, "weight", where)
    return scaled(q.to(torch.float32), scale, p.get("weight_zero_point"), w, where).to(scale.dtype)


LAYOUTS = {row.format: row for row in (
    Layout("nvfp4-pack-quantized", "nvfp4", _fp4_specs(16, torch.float8_e4m3fn, True), _decode_nvfp4),
    Layout("mxfp4-pack-quantized", "mxfp4", _fp4_specs(32, torch.uint8, False), _decode_mxfp4),
    Layout("pack-quantized", "int-packed", _packed_int_specs, _decode_packed_int),
    Layout("int-quantized", "int", _plain_specs(torch.int8), _decode_plain),
    Layout("float-quantized", "fp8", _plain_specs(torch.float8_e4m3fn), _decode_plain),
    Layout("naive-quantized", "fp8", _plain_specs(torch.float8_e4m3fn), _decode_plain),
)}
DECODERS = {fmt: row.decode for fmt, row in LAYOUTS.items()}
# the stored scales, each with whether it must be above zero (a global or static input scale
# divides or multiplies every value; a block or channel scale of zero is an all-zero block)
SCALES = {"weight_scale": False, "weight_global_scale": True, "input_global_scale": True,
          "input_scale": True}
INPUT_SCALES = ("input_global_scale", "input_scale")  # a static activation scale, in this order
SUFFIXES = (*SCALES, "weight_packed", "weight_zero_point", "weight_shape", "input_zero_point",
            "weight_g_idx")


def layout_of(kind: str, has_inputs: bool) -> Layout:
    """The format a stored-weight kind is written in (FP8 weights with quantized activations are
    `float-quantized`, alone `naive-quantized`, as llm-compressor names them)."""
    if kind == "fp8":
        return LAYOUTS["float-quantized" if has_inputs else "naive-quantized"]
    return next(row for row in LAYOUTS.values() if row.kind == kind)


# --- reading: config.json's quantization_config -------------------------------------------------

def parse(file: Path, q: dict) -> Checkpoint:
    """The checkpoint a compressed-tensors `quantization_config` (in config.json, `file`)
    describes, or a refusal naming the field qtransform cannot reproduce."""
    where = f"{file} quantization_config"
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise UserError(f"{where}: quantization_status {status!r}; only saved (compressed or "
                        "frozen) checkpoints are opened")
    if q.get("sparsity_config"):
        raise UserError(f"{where}: a sparsity_config, which qtransform does not decompress; "
                        "give a dense quantized checkpoint")
    rotations = parse_rotations(f"{where} transform_config", q.get("transform_config"))
    kv = _kv_scheme(q.get("kv_cache_scheme"), f"{where} kv_cache_scheme")
    groups = []
    config_groups = q.get("config_groups") or {}
    if not isinstance(config_groups, dict):
        raise UserError(f"{where}: config_groups must be an object of named groups")
    for name, g in sorted(config_groups.items()):
        if not isinstance(g, dict):
            raise UserError(f"{where}: config group {name!r} is not an object")
        fmt = g.get("format") or q.get("format")
        if fmt not in LAYOUTS:
            raise UserError(f"{where}: config group {name!r} has format {fmt!r}, which qtransform "
                            f"does not decompress (it reads {', '.join(LAYOUTS)})")
        if g.get("output_activations"):
            raise UserError(f"{where}: config group {name!r} quantizes output activations, which "
                            "qtransform does not read from checkpoints")
        targets = g.get("targets") or []
        if not targets or not all(isinstance(t, str) for t in targets):
            raise UserError(f"{where}: config group {name!r} has no targets")
        weights = _scheme(g.get("weights"), f"{where} group {name!r} weights")
        inputs = _scheme(g.get("input_activations"), f"{where} group {name!r} input_activations")
        if weights is None:
            raise UserError(f"{where}: config group {name!r} quantizes no weights; qtransform "
                            "opens weight-quantized checkpoints only")
        groups.append(Group(tuple(targets), weights, inputs, fmt))
    if not groups and kv is None and not rotations:
        raise UserError(f"{where}: no config_groups; not a quantized checkpoint")
    ignore = q.get("ignore") or []
    return Checkpoint(NAME, groups, [str(i) for i in ignore], rotations=rotations, kv=kv)


# a kv_cache_scheme's scales, by the key or value they scale (`self_attn.k_scale`: one per tensor
# [1], or per head [heads, 1, 1] for strategy attn_head, in the model's dtype)
KV_SCALES = {"k_scale": "key", "v_scale": "value"}
KV_STRATEGIES = {"tensor": "tensor", "attn_head": "head"}  # kv_cache_scheme strategy -> granularity
KV_OBSERVER = "minmax"  # llm-compressor's K/V observer when the scheme names none (measured)


def kv_owner(module: str) -> str:
    """The attention module whose key/value a `<module>.k_scale` scales: the module itself."""
    return module


def kv_value(fields: dict[str, Any], scale: Tensor) -> StoredScale:
    """A stored key/value scale as the KV rule's static scale: used as stored (x / scale)."""
    del fields
    return StoredScale(scale)


def _kv_scheme(a: object, where: str) -> KVScheme | None:
    """A kv_cache_scheme as the KV rule's fields, or a refusal naming the field."""
    if not a:
        return None
    if not isinstance(a, dict):
        raise UserError(f"{where}: not an object of QuantizationArgs")
    strategy = a.get("strategy")
    if (a.get("type"), a.get("num_bits")) != ("float", 8):
        raise UserError(f"{where}: {a.get('num_bits')}-bit {a.get('type')} keys and values; "
                        "qtransform reads FP8 (E4M3) KV caches")
    if strategy not in KV_STRATEGIES:
        raise UserError(f"{where}: strategy {strategy!r}; qtransform reads "
                        f"{' and '.join(KV_STRATEGIES)}")
    if a.get("dynamic") or not a.get("symmetric", True):
        raise UserError(f"{where}: dynamic or asymmetric keys and values; qtransform reads static, "
                        "symmetric KV scales")
    observer = a.get("observer") or KV_OBSERVER
    return KVScheme({"format": "fp8_e4m3", "scale_dtype": "input",
                     "granularity": KV_STRATEGIES[strategy], "scale_source": "static",
                     "observer": observer}, f"FP8 E4M3 per {KV_STRATEGIES[strategy]}")


def kv_args(cfg: QuantConfig, dtype: torch.dtype, per_head: bool, observer: str | None,
            where: str) -> str | Reason:
    """The kv_cache_scheme of keys and values quantized with `cfg` (one static scale per tensor,
    or per head) in a model of `dtype`, or why engines would compute other numbers."""
    if cfg.name != "fp8_e4m3" or cfg.granularity != "tensor":
        return Reason(f"{where}: compressed-tensors' kv_cache_scheme here is FP8 E4M3 with one "
                      'scale per tensor or per head (granularity "tensor" or "head")')
    if cfg.fp8_variant != "default" or cfg.rounding != "rne":
        return Reason(f"{where}: compressed-tensors quantizes keys and values as x / scale rounded "
                      "to nearest even; use fp8_variant 'default' and rounding 'rne'")
    if stored_scale_dtype(cfg, dtype) != dtype:
        return Reason(f"{where}: compressed-tensors computes KV scales in the model's dtype; use "
                      "scale_dtype 'input'")
    return args_json(num_bits=8, type="float", strategy="attn_head" if per_head else "tensor",
                     observer=None if observer in (None, KV_OBSERVER) else observer)


def kv_scale_spec(point: str, dtype: torch.dtype, heads: int | None) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """The stored scale of keys or values: [1], or [heads, 1, 1] per head, in the model's dtype."""
    suffix = next(k for k, v in KV_SCALES.items() if v == point)
    return suffix, dtype, (1,) if heads is None else (heads, 1, 1)


def _scheme(a: object, where: str) -> TensorScheme | None:
    """A QuantizationArgs dict as a TensorScheme, or a refusal naming the field."""
    if a is None:
        return None
    if not isinstance(a, dict):
        raise UserError(f"{where}: not an object of QuantizationArgs")
    kind, bits, strategy = a.get("type"), a.get("num_bits"), a.get("strategy")
    if a.get("actorder") not in (None, "static"):
        raise UserError(f"{where}: actorder {a.get('actorder')!r} (a weight permutation), which "
                        "qtransform does not read")
    known = {("float", 4, "tensor_group", 16), ("float", 4, "group", 32)}
    if kind == "float" and bits == 4 and (kind, bits, strategy, a.get("group_size")) not in known:
        raise UserError(f"{where}: 4-bit floats with strategy {strategy!r} and group_size "
                        f"{a.get('group_size')}: only NVFP4 (tensor_group 16) and MXFP4 (group 32) "
                        "are read")
    if kind not in ("int", "float"):
        raise UserError(f"{where}: element type {kind!r} is unknown")
    if bits not in (4, 8):
        raise UserError(f"{where}: {bits}-bit {kind} elements, which qtransform has no format for "
                        "(it reads fp4, fp8, int4 and int8)")
    if strategy not in STRATEGIES:
        raise UserError(f"{where}: strategy {strategy!r}, which qtransform does not read")
    block = a.get("block_structure")
    return TensorScheme(kind, bits, strategy, a.get("group_size"),
                        tuple(block) if block else None, a.get("dynamic", False),
                        bool(a.get("symmetric", True)))


STATIC = {"scale_source": "static", "observer": "static_minmax"}


def rule_fields(s: TensorScheme, tensor: str) -> dict[str, Any]:
    """The quantize-rule fields of one tensor scheme: what the llm-compressor presets write
    (schemas/presets/llm_compressor.py) for the scheme that saved it."""
    if s.kind == "float" and s.bits == 4 and s.group_size == 16:
        out: dict[str, Any] = {"format": "nvfp4", "nvfp4_variant": NAME, "scale_dtype": "input"}
        if tensor == "weight":
            out["share_scale"] = "fused"
        elif s.dynamic != True:  # noqa: E712 ("local": a static global scale, dynamic block scales)
            out.update(STATIC)
        return out
    if s.kind == "float" and s.bits == 4:
        return {"format": "mxfp4", "scale_rule": "even"}
    if not s.symmetric:
        raise UserError(f"{s.label()}: asymmetric integers (zero points) have no qtransform "
                        "format; the weights are open, but no policy describes them")
    out = {"format": {"float": "fp8_e4m3", "int": f"int{s.bits}"}[s.kind], "scale_dtype": "input"}
    if s.kind == "int":
        out["int_range"] = "full"
    out.update(granularity_fields(s))
    if tensor == "input" and not s.dynamic:
        out.update(STATIC)
    return out


def granularity_fields(s: TensorScheme) -> dict[str, Any]:
    """A plain-scale scheme's strategy as rule fields (granularity, tile or block size)."""
    gran = {"tensor": "tensor", "channel": "channel", "token": "token"}.get(s.strategy)
    if gran:
        return {"granularity": gran}
    if s.strategy == "block":
        return {"granularity": "tile", "block_shape": list(s.block or (128, 128))}
    return {"block_size": s.group_size}


# --- writing: a fake-quant's options as QuantizationArgs ------------------------------------------

def args_json(**fields: object) -> str:
    """QuantizationArgs as compressed-tensors serializes them (every field), as sorted JSON."""
    base = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
            "observer": None, "observer_kwargs": {}, "scale_dtype": None, "strategy": None,
            "symmetric": True, "zp_dtype": None}
    base.update(fields)
    return json.dumps(base, sort_keys=True)


def _strategy(cfg: QuantConfig) -> dict[str, Any]:
    if cfg.tile:
        return {"strategy": "block", "block_structure": list(cfg.tile)}
    strategy = _GRANULARITY[cfg.granularity]
    return {"strategy": strategy, "group_size": cfg.block if strategy == "group" else None}


def weight_args(cfg: QuantConfig, cols: int, has_inputs: bool, where: str) -> tuple[str, str] | Reason:
    """(QuantizationArgs, stored kind) of a weight quantized with `cfg`, or why it has none."""
    fam = cfg.family.name
    if not (cfg.tile is not None or cfg.granularity == "tensor" or cfg.block_axis in (-1, 1)):
        return Reason(f"{where}: blocks along axis {cfg.block_axis}; compressed-tensors blocks the input features (the last axis)")
    if fam == "nvfp4":
        if cfg.four_over_six != "none":
            return Reason(f"{where}: four_over_six scales as q * (s * d) (NVIDIA's order), which "
                          "compressed-tensors' q * (s / g) does not give back bit for bit; export "
                          "format='modelopt' (its decode is q * s * d)")
        if cfg.nvfp4_variant != NAME:
            return Reason(f"{where}: nvfp4_variant {cfg.nvfp4_variant!r} scales as q * s * d, compressed-tensors "
                          "decodes q * s / g; use nvfp4_variant 'compressed-tensors' (format='modelopt' "
                          "takes 'modelopt')")
        if cfg.tile or cols % 16:
            return Reason(f"{where}: NVFP4 in compressed-tensors is 1x16 blocks along rows of a multiple of 16")
        return args_json(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                         observer=WEIGHT_OBSERVER, scale_dtype="torch.float8_e4m3fn"), "nvfp4"
    if cfg.name == "mxfp4":
        if cfg.tile or cols % 32 or cfg.block != 32:
            return Reason(f"{where}: MXFP4 in compressed-tensors is 1x32 blocks along rows of a multiple of 32")
        return args_json(num_bits=4, type="float", strategy="group", group_size=32,
                         observer=WEIGHT_OBSERVER, scale_dtype="torch.uint8"), "mxfp4"
    if cfg.name == "fp8_e4m3":  # either fp8_variant: the stored scale is the one it multiplies by
        return args_json(num_bits=8, type="float", observer=WEIGHT_OBSERVER, **_strategy(cfg)), "fp8"
    if fam == "int":
        if cfg.int_range == "modelopt":
            return Reason(f"{where}: int_range 'modelopt' divides by a multiplier; compressed-tensors multiplies by a scale")
        strategy = _strategy(cfg)
        if strategy["strategy"] == "group" and cols % cfg.block:
            return Reason(f"{where}: int groups of {cfg.block} do not divide its {cols} input features")
        bits = 4 if cfg.name == "int4" else 8
        return (args_json(num_bits=bits, type="int", observer=WEIGHT_OBSERVER, **strategy),
                "int" if has_inputs else "int-packed")
    return Reason(f"{where}: format {cfg.name} has no compressed-tensors form here (nvfp4, mxfp4, "
                  "fp8_e4m3, int4, int8 do)")


def input_args(cfg: QuantConfig, dtype: torch.dtype, static: bool, observer: str | None,
               where: str) -> str | Reason:
    """QuantizationArgs of activations quantized with `cfg` (`static`: one calibrated scale,
    recorded with its `observer`) in a model of `dtype`, or why the engine would compute other
    numbers: activations are quantized by the engine with compressed-tensors' own rules, so only
    those rules (the llm-compressor presets' options) are written."""
    if cfg.rounding != "rne":
        return Reason(f"{where}: rounding {cfg.rounding!r}; engines round activations to nearest even")
    if cfg.block_axis not in (-1,) and cfg.granularity != "tensor":
        return Reason(f"{where}: blocks along axis {cfg.block_axis}; activations are blocked along the hidden axis")
    in_model_dtype = stored_scale_dtype(cfg, dtype) == dtype
    if cfg.family.name == "nvfp4":
        if cfg.nvfp4_variant != NAME or not in_model_dtype:
            return Reason(f"{where}: compressed-tensors quantizes NVFP4 activations in its own order with "
                          "scales in the model's dtype; use nvfp4_variant 'compressed-tensors' and "
                          "scale_dtype 'input' (the llm-compressor/NVFP4 preset's options)")
        if not static:
            return Reason(f"{where}: NVFP4 activations in compressed-tensors take one calibrated global "
                          "scale (input_global_scale); set scale_source 'static'")
        return args_json(num_bits=4, type="float", strategy="tensor_group", group_size=16, dynamic="local",
                         observer=observer, scale_dtype="torch.float8_e4m3fn")
    if cfg.name == "mxfp4":
        if cfg.scale_rule not in ("even", NAME) or cfg.block != 32:
            return Reason(f"{where}: scale_rule {cfg.scale_rule!r}; compressed-tensors computes MXFP4 "
                          "activation scales with rule 'even' on blocks of 32 and has no field for another rule")
        return args_json(num_bits=4, type="float", strategy="group", group_size=32, dynamic=True,
                         scale_dtype="torch.uint8")
    if cfg.name not in ("fp8_e4m3", "int8"):
        return Reason(f"{where}: format {cfg.name} has no compressed-tensors activation scheme here")
    if cfg.name == "fp8_e4m3" and cfg.fp8_variant != "default":
        return Reason(f"{where}: fp8_variant {cfg.fp8_variant!r}; compressed-tensors' FP8 is the 'default' order")
    if cfg.name == "int8" and cfg.int_range != "full":
        return Reason(f"{where}: int_range {cfg.int_range!r}; compressed-tensors quantizes int8 "
                      "activations over the full range (amax / 127.5): use int_range 'full'")
    if not in_model_dtype:
        return Reason(f"{where}: scale_dtype {cfg.scale_dtype!r} on a {str(dtype).removeprefix('torch.')} "
                      "model; compressed-tensors computes activation scales in the model's dtype: "
                      "use scale_dtype 'input'")
    if cfg.tile:
        return Reason(f"{where}: activation tiles have no compressed-tensors field")
    kind = {"num_bits": 8, "type": "float" if cfg.name == "fp8_e4m3" else "int"}
    if cfg.granularity == "tensor":
        if static:
            return args_json(**kind, strategy="tensor", observer=observer)
        return args_json(**kind, strategy="tensor", dynamic=True)
    if cfg.granularity in ("token", "channel"):
        return args_json(**kind, strategy="token", dynamic=True)
    return args_json(**kind, strategy="group", group_size=cfg.block, dynamic=True)


def input_scale_spec(cfg: QuantConfig, dtype: torch.dtype) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """The stored static input scale: NVFP4's fp32 global scale, else the scale in its dtype."""
    if cfg.family.name == "nvfp4":
        return ("input_global_scale", torch.float32, (1,))
    return ("input_scale", stored_scale_dtype(cfg, dtype), (1,))


# --- the policy of an opened checkpoint -----------------------------------------------------------

CALIBRATION = {"attention": "eager"}  # llm-compressor calibrates static scales so (its presets)


def ignored_entries(ignore: list[str], names: list[str]) -> list[str]:
    """The checkpoint's ignore list as qtransform entries on a model with modules `names`."""
    return ct_ignored_entries(ignore, names)
