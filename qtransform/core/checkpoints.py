"""Quantized checkpoints opened back: compressed-tensors and ModelOpt folders, decompressed by our
own code, and the qtransform policy that describes their quantization.

A released NVFP4A16 folder holds packed codes and scales, not weights; transformers needs the
compressed-tensors library (or a GPU engine) to read it. This module reads the layouts itself
(the main environment has neither library), so every command opens such a folder as a plain
model whose weights are the checkpoint's dequantized values, and knows which scheme made them:

- compressed-tensors (`config.json` `quantization_config`, `quant_method` "compressed-tensors"):
  `nvfp4-pack-quantized` (`weight_packed` E2M1 nibbles, E4M3 `weight_scale`, fp32
  `weight_global_scale` g: value = code * (scale / g)), `mxfp4-pack-quantized` (uint8 E8M0
  exponents), `pack-quantized` (ints packed densely into int32 words, offset by 2^(bits-1),
  optional packed zero points), `int-quantized` / `float-quantized` / `naive-quantized` (int8 or
  FP8 `weight` times `weight_scale` per tensor, channel, group or 2-D block);
- ModelOpt (`hf_quant_config.json`, `quant_algo` NVFP4 or FP8): `weight` (packed E2M1 or FP8),
  `weight_scale`, `weight_scale_2` (NVFP4's global decode scale), `input_scale`.

A compressed-tensors `transform_config` (online Hadamard rotations, the stored weights holding
W·R) is read by `core.checkpoint_rotations` where qtransform reproduces it exactly; the policy
then rotates those inputs only (rotate rule `weight: "stored"`).

Each value is dequantized as its library does (the product in fp32, rounded once to the model's
dtype), so a bf16 model equals compressed-tensors' own decompression bit for bit. (For FP4 that
library returns bf16 whatever the model's dtype; here an fp32 model keeps the exact products.) What these readers do not know is refused with a UserError naming it, never guessed.
The policy is a plain dict (the policy layer sits above this one); `describe` says in words
what the checkpoint is.
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qtransform.core import io as qio
from qtransform.core.checkpoint_rotations import RotationGroup, check_matrix
from qtransform.core.checkpoint_rotations import bind as bind_groups
from qtransform.core.checkpoint_rotations import parse as parse_rotations
from qtransform.errors import UserError
from qtransform.formats.elements import decode_elements
from qtransform.formats.registry import E2M1

COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"
MODELOPT_FILE = "hf_quant_config.json"
CT_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized", "pack-quantized", "int-quantized",
              "float-quantized", "naive-quantized")
MODELOPT_ALGOS = ("NVFP4", "FP8")
ATTRIBUTE = "_qtransform_checkpoint"  # where load_model keeps the Checkpoint on the model



@dataclass(frozen=True)
class TensorScheme:
    """How one tensor role (weights or input activations) of a config group is quantized."""

    kind: str  # "int" | "float"
    bits: int
    strategy: str  # tensor | channel | group | tensor_group | block | token
    group_size: int | None = None
    block: tuple[int, int] | None = None
    dynamic: bool | str = False
    symmetric: bool = True

    def label(self) -> str:
        """The scheme's name in compressed-tensors' words (nvfp4, mxfp4, int4 group 128, ...)."""
        if self.kind == "float" and self.bits == 4:
            return "nvfp4" if self.group_size == 16 else "mxfp4"
        base = f"{'fp' if self.kind == 'float' else 'int'}{self.bits}"
        if self.strategy == "group":
            return f"{base} groups of {self.group_size}"
        if self.strategy == "block":
            return f"{base} {self.block[0]}x{self.block[1]} blocks"
        return f"{base} per {self.strategy}" + ("" if self.symmetric else " with zero points")


@dataclass(frozen=True)
class Group:
    """One config group: the modules its targets match, and their weight and input schemes."""

    targets: tuple[str, ...]
    weights: TensorScheme | None
    inputs: TensorScheme | None
    format: str


@dataclass
class Checkpoint:
    """What a quantized folder holds: producer, groups, ignored modules, static input scales,
    online rotations (and, once bound to a model, the modules each rotates)."""

    producer: str
    groups: list[Group]
    ignore: list[str]
    modules: dict[str, int] = field(default_factory=dict)  # quantized module -> group index
    input_scales: dict[str, Tensor] = field(default_factory=dict)  # module -> stored input scale
    rotations: list[RotationGroup] = field(default_factory=list)
    rotated: dict[str, list[str]] = field(default_factory=dict)  # rotation group -> its modules

    def scheme(self) -> str:
        """A short name: W<weights>A<inputs> in the words of `TensorScheme.label`."""
        parts = []
        for g in self.groups:
            w = g.weights.label() if g.weights else "16-bit"
            a = g.inputs.label() if g.inputs else "16-bit"
            parts.append(f"weights {w}, activations {a}")
        return "; ".join(parts)


def detect(path: Path, config: dict) -> Checkpoint | None:
    """The checkpoint description of a model folder, or None for an unquantized one."""
    modelopt = path / MODELOPT_FILE
    if modelopt.exists():
        text = qio.read_input_text(modelopt, MODELOPT_FILE, limit=16 * 2**20)
        return _modelopt(modelopt, _json(text, modelopt))
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == MODELOPT:
        return _modelopt(path / "config.json", q)
    if method != COMPRESSED_TENSORS:
        raise UserError(f"{path}: a {method!r} quantized checkpoint, which qtransform cannot open "
                        f"(it reads {COMPRESSED_TENSORS} and {MODELOPT} checkpoints); give the "
                        "unquantized model or one of those")
    return _compressed_tensors(path, q)


def _json(text: str, file: Path) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: not a JSON object")
    return data


def _compressed_tensors(path: Path, q: dict) -> Checkpoint:
    where = f"{path}/config.json quantization_config"
    status = q.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise UserError(f"{where}: quantization_status {status!r}; only saved (compressed or "
                        "frozen) checkpoints are opened")
    if q.get("sparsity_config"):
        raise UserError(f"{where}: a sparsity_config, which qtransform does not decompress; "
                        "give a dense quantized checkpoint")
    rotations = parse_rotations(f"{where} transform_config", q.get("transform_config"))
    if q.get("kv_cache_scheme"):
        raise UserError(f"{where}: a kv_cache_scheme, which qtransform does not describe yet")
    groups = []
    for name, g in sorted((q.get("config_groups") or {}).items()):
        fmt = g.get("format") or q.get("format")
        if fmt not in CT_FORMATS:
            raise UserError(f"{where}: config group {name!r} has format {fmt!r}, which qtransform "
                            f"does not decompress (it reads {', '.join(CT_FORMATS)})")
        if g.get("output_activations"):
            raise UserError(f"{where}: config group {name!r} quantizes output activations, which "
                            "qtransform does not read from checkpoints")
        targets = g.get("targets") or []
        if not targets or not all(isinstance(t, str) for t in targets):
            raise UserError(f"{where}: config group {name!r} has no targets")
        weights = _args(g.get("weights"), f"{where} group {name!r} weights")
        inputs = _args(g.get("input_activations"), f"{where} group {name!r} input_activations")
        if weights is None:
            raise UserError(f"{where}: config group {name!r} quantizes no weights; qtransform "
                            "opens weight-quantized checkpoints only")
        groups.append(Group(tuple(targets), weights, inputs, fmt))
    if not groups:
        raise UserError(f"{where}: no config_groups; not a quantized checkpoint")
    ignore = q.get("ignore") or []
    return Checkpoint(COMPRESSED_TENSORS, groups, [str(i) for i in ignore], rotations=rotations)


def bind_rotations(checkpoint: Checkpoint, modules: Iterable[tuple[str, Any]]) -> None:
    """Each rotation group's modules in the model (`checkpoint.rotated`), checked."""
    checkpoint.rotated = bind_groups(checkpoint.rotations, modules)


def _args(a: Any, where: str) -> TensorScheme | None:
    """A compressed-tensors QuantizationArgs dict as a TensorScheme, or a refusal naming the field."""
    if a is None:
        return None
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
    if strategy not in ("tensor", "channel", "group", "tensor_group", "block", "token"):
        raise UserError(f"{where}: strategy {strategy!r}, which qtransform does not read")
    block = a.get("block_structure")
    return TensorScheme(kind, bits, strategy, a.get("group_size"),
                        tuple(block) if block else None, a.get("dynamic", False),
                        bool(a.get("symmetric", True)))


def _modelopt(file: Path, data: dict) -> Checkpoint:
    q = data.get("quantization", data)
    algo = q.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise UserError(f"{file}: ModelOpt quant_algo {algo!r}, which qtransform does not open "
                        f"(it reads {', '.join(MODELOPT_ALGOS)})")
    if q.get("kv_cache_quant_algo"):
        raise UserError(f"{file}: kv_cache_quant_algo {q['kv_cache_quant_algo']!r}, which "
                        "qtransform does not describe yet")
    if algo == "NVFP4":
        group = q.get("group_size", 16)
        if group != 16:
            raise UserError(f"{file}: NVFP4 with group_size {group}; only 16 is read")
        w = TensorScheme("float", 4, "tensor_group", 16)
        g = Group(("Linear",), w, TensorScheme("float", 4, "tensor_group", 16, dynamic="local"),
                  "modelopt-nvfp4")
    else:
        w = TensorScheme("float", 8, "tensor")
        g = Group(("Linear",), w, TensorScheme("float", 8, "tensor"), "modelopt-fp8")
    return Checkpoint(MODELOPT, [g], [str(m) for m in q.get("exclude_modules") or []])


# --- decompression -------------------------------------------------------------------------------

def decompress(checkpoint: Checkpoint, tensors: Iterable[tuple[str, Tensor]],
               dtype: torch.dtype) -> dict[str, Tensor]:
    """The model state dict of a checkpoint's tensors: every quantized module's weight decoded,
    other tensors cast to `dtype`; fills `checkpoint.modules` and `input_scales`."""
    parts: dict[str, dict[str, Tensor]] = {}
    plain: dict[str, Tensor] = {}
    matrices = {f"{g.name}_input": g for g in checkpoint.rotations}
    suffixes = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point",
                "weight_shape", "input_global_scale", "input_scale", "weight_scale_2",
                "input_zero_point", "weight_g_idx")
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and (group := matrices.get(module.rpartition(".")[2])) is not None:
            check_matrix(group, name, t)  # the online transform's matrix: no model tensor
            continue
        if leaf in suffixes:
            parts.setdefault(module, {})[leaf] = t
        else:
            plain[name] = t
    out = {}
    for name, t in plain.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in parts:
            parts[module]["weight"] = t
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    for module, p in parts.items():
        index = _group_of(checkpoint, module)
        group = checkpoint.groups[index]
        where = f"{module} ({group.format})"
        if "weight_g_idx" in p:
            raise UserError(f"{where}: weight_g_idx (activation-order groups), which qtransform "
                            "does not read")
        out[module + ".weight"] = _decode(group, p, where).to(dtype)
        checkpoint.modules[module] = index
        scale = p.get("input_global_scale", p.get("input_scale"))
        if scale is not None:
            checkpoint.input_scales[module] = scale.detach().to(torch.float32).reshape(())
    return out


def _group_of(checkpoint: Checkpoint, module: str) -> int:
    """The config group a module belongs to: a `re:` target that matches its name (compressed-
    tensors' re.match), else the one group targeting classes."""
    by_class = []
    for i, g in enumerate(checkpoint.groups):
        for t in g.targets:
            if t.startswith("re:"):
                if re.match(t[3:], module):
                    return i
            elif t == module:
                return i
            else:
                by_class.append(i)
    found = sorted(set(by_class))
    if len(found) == 1:
        return found[0]
    raise UserError(f"{module}: quantized tensors, but {'no' if not found else 'several'} config "
                    f"groups target it by class; qtransform opens checkpoints whose groups it can "
                    "tell apart by module name")


def _need(p: dict[str, Tensor], key: str, where: str) -> Tensor:
    if key not in p:
        raise UserError(f"{where}: no {key} tensor; the checkpoint is incomplete or of another "
                        "layout")
    return p[key]


def _decode(group: Group, p: dict[str, Tensor], where: str) -> Tensor:
    """One module's weight, dequantized as its library does."""
    w = group.weights
    assert w is not None
    if group.format == "modelopt-nvfp4":
        codes = unpack_fp4(_need(p, "weight", where))
        scale = _need(p, "weight_scale", where).to(torch.float32)
        per_block = scale * _need(p, "weight_scale_2", where).to(torch.float32).reshape(())
        return _blockwise(codes, per_block, 16, where)
    if group.format == "modelopt-fp8":
        return _scaled(_need(p, "weight", where).to(torch.float32),
                       _need(p, "weight_scale", where).to(torch.float32), None, w, where)
    if group.format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        codes = unpack_fp4(_need(p, "weight_packed", where))
        raw = _need(p, "weight_scale", where)
        if group.format == "mxfp4-pack-quantized":
            scale = e8m0_values(raw).to(torch.bfloat16)
        else:  # compressed-tensors: the E4M3 scale in bf16, divided by the fp32 global scale
            g = _need(p, "weight_global_scale", where).to(torch.float32).reshape(())
            scale = raw.to(torch.bfloat16).to(torch.float32) / g
        return _blockwise(codes, scale.to(torch.float32), w.group_size or 16, where)
    scale = _need(p, "weight_scale", where)
    if group.format == "pack-quantized":
        shape = [int(v) for v in _need(p, "weight_shape", where).tolist()]
        q = unpack_int32(_need(p, "weight_packed", where), w.bits, shape[-1])
        zp = p.get("weight_zero_point")
        if zp is not None and zp.dtype == torch.int32:  # packed along the output axis
            zp = unpack_int32(zp.t().contiguous(), w.bits, shape[0]).t()
    else:
        q, zp = _need(p, "weight", where), p.get("weight_zero_point")
    return _scaled(q.to(torch.float32), scale, zp, w, where).to(scale.dtype)


def _scaled(q: Tensor, scale: Tensor, zp: Tensor | None, w: TensorScheme, where: str) -> Tensor:
    """(q - zero point) * scale with the scale spread over its tensor, channel, group or block."""
    s = scale.to(torch.float32)
    z = None if zp is None else zp.to(torch.float32)
    rows, cols = q.shape
    misfit = UserError(f"{where}: weight_scale of shape {list(scale.shape)} does not fit "
                       f"{w.label()} on a [{rows}, {cols}] weight")
    if w.strategy in ("tensor", "channel") or s.numel() == 1:
        if s.numel() not in (1, rows):
            raise misfit
        s = s.reshape(-1, 1)
        z = None if z is None else z.reshape(s.shape)
    elif w.strategy in ("group", "tensor_group"):
        size = w.group_size or cols
        if s.shape != (rows, -(-cols // size)):
            raise misfit
        s = s.repeat_interleave(size, dim=1)[:, :cols]
        z = None if z is None else z.repeat_interleave(size, dim=1)[:, :cols]
    elif w.strategy == "block" and w.block:
        bh, bw = w.block
        if s.shape != (-(-rows // bh), -(-cols // bw)):
            raise misfit
        s = s.repeat_interleave(bh, dim=0).repeat_interleave(bw, dim=1)[:rows, :cols]
        z = None if z is None else z.repeat_interleave(bh, dim=0).repeat_interleave(bw, dim=1)[:rows, :cols]
    else:
        raise UserError(f"{where}: weight strategy {w.strategy!r} is not read")
    return (q if z is None else q - z) * s


def _blockwise(codes: Tensor, scale: Tensor, block: int, where: str) -> Tensor:
    rows, cols = codes.shape
    if scale.shape != (rows, cols // block):
        raise UserError(f"{where}: weight_scale of shape {list(scale.shape)} does not fit blocks of "
                        f"{block} on a [{rows}, {cols}] weight")
    return (codes.reshape(rows, -1, block) * scale.unsqueeze(-1)).reshape(rows, cols)


def unpack_fp4(packed: Tensor) -> Tensor:
    """fp32 E2M1 values of uint8 bytes holding two codes each, the even element in the low nibble
    (compressed-tensors' and ModelOpt's order)."""
    if packed.dtype != torch.uint8:
        raise UserError(f"packed FP4 weights must be uint8, not {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return decode_elements(codes, E2M1)


def e8m0_values(codes: Tensor) -> Tensor:
    """fp32 powers of two 2^(code - 127) of E8M0 scale codes (255, NaN, is refused upstream by
    the library that wrote them; here it decodes to NaN)."""
    values = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes.to(torch.int32) - 127)
    return torch.where(codes == 255, torch.full_like(values, float("nan")), values)


def unpack_int32(words: Tensor, bits: int, cols: int) -> Tensor:
    """Signed integers packed densely along the last axis of int32 words (element i at bit
    i*bits of the row's little-endian bit stream, stored as value + 2^(bits-1)), cut to `cols`."""
    if words.dtype != torch.int32:
        raise UserError(f"packed integer weights must be int32, not {words.dtype}")
    rows = words.shape[0]
    stream = words.contiguous().view(torch.uint8).reshape(rows, -1)  # little-endian bytes
    if bits == 8:
        values = stream.to(torch.int32)
    elif bits == 4:
        values = torch.stack((stream & 0x0F, stream >> 4), dim=-1).reshape(rows, -1).to(torch.int32)
    else:
        bit = (stream.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        flat = bit.reshape(rows, -1)[:, : (flat_len := (bit.shape[1] * 8) // bits * bits)]
        weights = 2 ** torch.arange(bits, dtype=torch.int32)
        values = (flat.reshape(rows, flat_len // bits, bits).to(torch.int32) * weights).sum(-1)
    if values.shape[1] < cols:
        raise UserError(f"packed weights hold {values.shape[1]} values per row, the shape says {cols}")
    return values[:, :cols] - (1 << (bits - 1))


# --- the policy ----------------------------------------------------------------------------------

def ct_entry(entry: str) -> str:
    """The qtransform selector entry matching what compressed-tensors matches with `entry`:
    `re:X` is re.match (anchored at the start only), a class name stays, a module name is exact."""
    if entry.startswith("re:"):
        return f"re:(?:{entry[3:]}).*"
    if entry.isidentifier() and entry[0].isupper():
        return entry
    return "re:" + re.escape(entry)


def _ignore_entries(checkpoint: Checkpoint, names: list[str]) -> list[str]:
    """The checkpoint's ignore list as qtransform entries, keeping those that name a module of
    the model (a policy entry that matches nothing is an error; the producers list more)."""
    if checkpoint.producer == MODELOPT:
        pats = [fnmatch.translate(p) for p in checkpoint.ignore
                if any(fnmatch.fnmatchcase(n, p) for n in names)]
        return [f"re:(?:{'|'.join(pats)})"] if pats else []
    entries = []
    for entry in checkpoint.ignore:
        if entry.startswith("re:"):
            hit = any(re.match(entry[3:], n) for n in names)
        else:
            hit = entry in names
        if hit:
            entries.append(ct_entry(entry))
    return entries


def policy(checkpoint: Checkpoint, names: list[str], *, weights: bool = False) -> dict:
    """The qtransform policy (a plain dict) that turns the opened checkpoint into the model its
    library deploys, on a model whose module names are `names`.

    The weights already hold the checkpoint's quantized values, so the policy quantizes the
    activations only: re-quantizing the weights would stack a second rounding (NVFP4 recomputes
    its global scale from the smaller dequantized amax; compressed-tensors' integers reach
    -2^(bits-1), which moves amax/(qmax+0.5)). Each rule's name says what the weights are.
    Static input scales are the checkpoint's stored ones, used as stored (`input_scales`, in
    the terms of each rule's format: NVFP4's g or d, FP8's scale). `weights=True` adds each
    group's weight rule first: the whole scheme, for the full-precision model the checkpoint was
    made from (the same numbers as the producer's preset).

    Online rotations become `rotate` rules on their modules by name: `weight: "stored"` (the
    stored weights hold W·R, only the inputs are rotated), or with `weights=True` ordinary
    rules (the full-precision model's weights get W·R, as the producer fused it)."""
    ignore = _ignore_entries(checkpoint, names)
    rules: list[dict[str, Any]] = []
    for i, g in enumerate(checkpoint.groups if weights else ()):
        if g.weights is not None:
            rules.append({"name": f"{checkpoint.producer} group {i} weights",
                          "targets": [ct_entry(t) for t in g.targets], "ignore": list(ignore),
                          "tensors": ["weight"], **_rule(g.weights, g.format, "weight")})
    for i, g in enumerate(checkpoint.groups):
        if g.inputs is None:
            continue
        label = g.weights.label() if g.weights else "16-bit"
        rules.append({"name": f"{checkpoint.producer} group {i} inputs (weights {label} in the "
                              "checkpoint)",
                      "targets": [ct_entry(t) for t in g.targets], "ignore": list(ignore),
                      "tensors": ["input"], **_rule(g.inputs, g.format, "input")})
    out: dict[str, Any] = {"version": 1, "quantize": rules}
    if checkpoint.rotations:
        out["rotate"] = [{"name": g.name, "targets": [ct_entry(n) for n in checkpoint.rotated[g.name]],
                          "kind": "hadamard", "block_size": g.block,
                          "weight": "rotate" if weights else "stored"}
                         for g in checkpoint.rotations]
    if checkpoint.producer != MODELOPT and any(r.get("scale_source") == "static" for r in rules):
        out["calibration"] = {"attention": "eager"}  # llm-compressor calibrates so (its presets)
    return out


def _rule(s: TensorScheme, fmt: str, tensor: str) -> dict[str, Any]:
    """The quantize-rule fields of one tensor scheme (the llm-compressor and ModelOpt presets'
    fields, schemas/presets)."""
    modelopt = fmt.startswith("modelopt")
    static = {"scale_source": "static", "observer": "static_minmax"}
    if s.kind == "float" and s.bits == 4 and s.group_size == 16:
        out: dict[str, Any] = {"format": "nvfp4",
                               "nvfp4_variant": "modelopt" if modelopt else "compressed-tensors"}
        if not modelopt:
            out["scale_dtype"] = "input"
        if tensor == "weight":
            out["share_scale"] = "fused"
        elif s.dynamic != True:  # noqa: E712 (compressed-tensors: "local" = a static global scale)
            out.update(static)
        return out
    if s.kind == "float" and s.bits == 4:
        return {"format": "mxfp4", "scale_rule": "even"}
    fmt_name = {"float": "fp8_e4m3", "int": f"int{s.bits}"}[s.kind]
    if not s.symmetric:
        raise UserError(f"{s.label()}: asymmetric integers (zero points) have no qtransform "
                        "format; the weights are open, but no policy describes them")
    out = {"format": fmt_name}
    if modelopt:
        out["fp8_variant"] = "modelopt"
    else:
        out["scale_dtype"] = "input"
    if s.kind == "int":
        out["int_range"] = "full"
    gran = {"tensor": "tensor", "channel": "channel", "token": "token"}.get(s.strategy)
    if gran:
        out["granularity"] = gran
    elif s.strategy == "block":
        out.update(granularity="tile", block_shape=list(s.block or (128, 128)))
    else:
        out["block_size"] = s.group_size
    if tensor == "input" and not s.dynamic:
        out.update(static)
    return out


def describe(checkpoint: Checkpoint) -> list[str]:
    """Lines that say what the checkpoint is (plan's header)."""
    lines = [f"{checkpoint.producer} checkpoint: {checkpoint.scheme()}",
             f"  {len(checkpoint.modules)} quantized modules"
             + (f"; kept in high precision: {', '.join(checkpoint.ignore)}" if checkpoint.ignore else "")]
    if checkpoint.input_scales:
        lines.append(f"  static input scales of {len(checkpoint.input_scales)} modules (from the checkpoint)")
    for g in checkpoint.rotations:
        count = len(checkpoint.rotated.get(g.name, ()))
        width = f"{g.block}-wide" if g.block else "whole-axis"
        lines.append(f"  online {width} Hadamard rotations ({g.name!r}) of the inputs of {count} "
                     "modules, whose stored weights hold W·R")
    return lines
