"""Opening a quantized folder: which format wrote it (`detect`), and its tensors as the model's
state dict (`decompress`), every quantized module's weight decoded by its format's layout.

Every tensor comes through the one safetensors reader (`shards.TensorFiles`: headers, the index
and the shards checked), and nothing in it is trusted before it is checked: a scale that is NaN,
infinite, negative (or zero where it divides), a missing scale tensor, a scale whose shape does
not fit its weight, and a weight stored in a quantized dtype without its scales are each refused
in one line naming the tensor and the file, never opened as a silently wrong model.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from qtransform.checkpoints import compressed_tensors, modelopt
from qtransform.checkpoints.description import Checkpoint, check_scale
from qtransform.checkpoints.matching import REGEX, ct_matches
from qtransform.checkpoints.rotations import check_matrix
from qtransform.checkpoints.shards import TensorFiles
from qtransform.core import io as qio
from qtransform.errors import UserError

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (compressed_tensors, modelopt)}
MARKERS = tuple(m.FILE for m in FORMATS.values() if m.FILE)  # files that make a folder quantized
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)
E8M0_NAN = 255


def detect(path: Path, config: dict) -> Checkpoint | None:
    """The checkpoint description of a model folder, or None for an unquantized one."""
    for fmt in FORMATS.values():
        marker = path / fmt.FILE if fmt.FILE else None
        if marker is not None and marker.exists():
            text = qio.read_input_text(marker, fmt.FILE, limit=16 * 2**20)
            return fmt.parse(marker, _json(text, marker))
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method not in FORMATS:
        raise UserError(f"{path}: a {method!r} quantized checkpoint, which qtransform cannot open "
                        f"(it reads {' and '.join(FORMATS)} checkpoints); give the unquantized "
                        "model or one of those")
    return FORMATS[method].parse(path / "config.json", q)


def _json(text: str, file: Path) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: not a JSON object")
    return data


def decompress(checkpoint: Checkpoint, files: TensorFiles, dtype: torch.dtype) -> dict[str, Tensor]:
    """The model state dict of a checkpoint's tensors: every quantized module's weight decoded,
    other tensors cast to `dtype`; fills `checkpoint.modules`, `input_scales` and
    `weight_scales` (an engine's linear kernels read the stored weight scales)."""
    fmt = FORMATS[checkpoint.producer]
    suffixes = set(fmt.SUFFIXES)
    parts: dict[str, dict[str, Tensor]] = {}
    plain: dict[str, Tensor] = {}
    where_of: dict[str, Path] = {}
    matrices = {f"{g.name}_{location}": g for g in checkpoint.rotations for location in g.locations()}
    for name, t, file in files.items():
        module, _, leaf = name.rpartition(".")
        where_of[name] = file
        if leaf == "weight" and (group := matrices.get(module.rpartition(".")[2])) is not None:
            check_matrix(group, name, t)  # the online transform's matrix: no model tensor
            continue
        if leaf in fmt.KV_SCALES:
            _kv_scale(checkpoint, fmt, module, leaf, t, f"{file}: {name}")
        elif leaf in suffixes:
            parts.setdefault(module, {})[leaf] = t
        else:
            plain[name] = t
    out = {}
    for name, t in plain.items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in parts:
            parts[module]["weight"] = t
        elif name.endswith(".weight") and t.dtype in QUANTIZED_DTYPES:
            raise UserError(f"{where_of[name]}: tensor {name} is stored as "
                            f"{str(t.dtype).removeprefix('torch.')} without its scales (no "
                            f"{module}.weight_scale); the checkpoint is incomplete: re-export it")
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    for module, p in parts.items():
        index = _group_of(checkpoint, module)
        group = checkpoint.groups[index]
        assert group.weights is not None
        file = next((where_of[f"{module}.{leaf}"] for leaf in p if f"{module}.{leaf}" in where_of), None)
        where = f"{file}: {module} ({group.format})"
        if "weight_g_idx" in p:
            raise UserError(f"{where}: weight_g_idx (activation-order groups), which qtransform "
                            "does not read")
        _check_scales(module, p, fmt.SCALES, where)
        out[module + ".weight"] = fmt.DECODERS[group.format](p, group.weights, where).to(dtype)
        checkpoint.modules[module] = index
        if "weight_scale" in p and not (group.weights.kind == "float" and group.weights.bits == 4):
            checkpoint.weight_scales[module] = p["weight_scale"].detach()  # FP4's (1 per 16-32) not kept
        scale = next((p[k] for k in fmt.INPUT_SCALES if k in p), None)
        if scale is not None:
            checkpoint.input_scales[module] = scale.detach().to(torch.float32).reshape(())
    settle = getattr(fmt, "settle_inputs", None)
    if settle is not None and parts:
        without = [m for m in parts if m not in checkpoint.input_scales]
        settle(checkpoint, sorted(checkpoint.input_scales), sorted(without), str(next(iter(where_of.values()))))
    return out


def _kv_scale(checkpoint: Checkpoint, fmt: ModuleType, module: str, leaf: str, t: Tensor, where: str) -> None:
    """A stored key or value scale, kept (one value per head, or one) for the KV rule."""
    if checkpoint.kv is None:
        raise UserError(f"{where}: a KV-cache scale, but the checkpoint's config declares no KV "
                        "cache scheme; the folder is inconsistent: re-export it")
    check_scale(t, leaf, where, positive=True)
    checkpoint.kv_scales[(fmt.kv_owner(module), fmt.KV_SCALES[leaf])] = t.detach().to(torch.float32).reshape(-1)


def _check_scales(module: str, p: dict[str, Tensor], scales: dict[str, bool], where: str) -> None:
    for leaf, positive in scales.items():
        t = p.get(leaf)
        if t is None:
            continue
        if t.dtype == torch.uint8:  # E8M0 exponent codes: 255 is NaN
            if bool((t == E8M0_NAN).any()):
                raise UserError(f"{where}: tensor {module}.{leaf} holds E8M0 NaN codes (255); the "
                                "checkpoint is corrupt, re-export it")
        else:
            check_scale(t, f"{module}.{leaf}", where, positive=positive)
    for leaf in (k for k, positive in scales.items() if positive):
        if leaf in p and p[leaf].numel() != 1:
            raise UserError(f"{where}: tensor {module}.{leaf} has shape {list(p[leaf].shape)}; a "
                            "global or static input scale is one value")


def _group_of(checkpoint: Checkpoint, module: str) -> int:
    """The config group a module belongs to: a target that names it (compressed-tensors' match:
    `re:` anchored at the start, or the exact name), else the one group targeting classes."""
    by_class = []
    for i, g in enumerate(checkpoint.groups):
        for t in g.targets:
            if ct_matches(t, module):
                return i
            if not t.startswith(REGEX):
                by_class.append(i)
    found = sorted(set(by_class))
    if len(found) == 1:
        return found[0]
    raise UserError(f"{module}: quantized tensors, but {'no' if not found else 'several'} config "
                    f"groups target it by class; qtransform opens checkpoints whose groups it can "
                    "tell apart by module name")
