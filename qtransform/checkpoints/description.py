"""What a quantized checkpoint says, in words every format shares: the tensor schemes of its
config groups, the modules they quantize, the stored static input scales and online rotations;
and the decoding arithmetic the formats share (elements times a scale spread over its tensor,
channel, group, block or tile), with the checks that keep a hostile file from opening as a
silently wrong model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qtransform.checkpoints.rotations import RotationGroup
from qtransform.errors import UserError

Specs = list[tuple[str, torch.dtype, tuple[int, ...]]]  # a layout's stored tensors: (suffix, dtype, shape)


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
    """One config group: the modules its targets match, their weight and input schemes, and the
    format module's layout that stores them."""

    targets: tuple[str, ...]
    weights: TensorScheme | None
    inputs: TensorScheme | None
    format: str


@dataclass(frozen=True)
class KVScheme:
    """A checkpoint's KV cache: the quantize-rule fields of its keys and values (the scales are
    the stored ones) and a short label."""

    fields: dict[str, Any]
    label: str


@dataclass
class Checkpoint:
    """What a quantized folder holds: producer (the format's name), groups, ignored modules,
    static input scales, online rotations (and, once bound to a model, the modules each
    rotates)."""

    producer: str
    groups: list[Group]
    ignore: list[str]
    modules: dict[str, int] = field(default_factory=dict)  # quantized module -> group index
    input_scales: dict[str, Tensor] = field(default_factory=dict)  # module -> stored input scale
    weight_scales: dict[str, Tensor] = field(default_factory=dict)  # module -> stored weight_scale
    rotations: list[RotationGroup] = field(default_factory=list)
    rotated: dict[str, list[str]] = field(default_factory=dict)  # rotation group -> its modules
    kv: KVScheme | None = None  # the KV cache's scheme (keys and values of every attention)
    # (attention module, "key" or "value") -> its stored scales, one per head or one ([1])
    kv_scales: dict[tuple[str, str], Tensor] = field(default_factory=dict)

    def scheme(self) -> str:
        """A short name: W<weights>A<inputs> in the words of `TensorScheme.label`."""
        parts = []
        for g in self.groups:
            w = g.weights.label() if g.weights else "16-bit"
            a = g.inputs.label() if g.inputs else "16-bit"
            parts.append(f"weights {w}, activations {a}")
        if self.kv is not None:
            parts.append(f"KV cache {self.kv.label}")
        return "; ".join(parts) or "16-bit weights and activations, online rotations only"


@dataclass(frozen=True)
class Reason:
    """Why something has no form in a format (a value, so callers collect every reason)."""

    text: str


# --- decoding shared by the formats --------------------------------------------------------------

def need(p: dict[str, Tensor], key: str, where: str) -> Tensor:
    """The stored tensor `key` of a module, or a refusal naming it."""
    if key not in p:
        raise UserError(f"{where}: no {key} tensor; the checkpoint is incomplete or of another "
                        "layout")
    return p[key]


def check_scale(t: Tensor, name: str, where: str, *, positive: bool) -> None:
    """A stored scale must be finite and not negative (`positive`: above zero, as a global or
    static input scale divides or multiplies every value): a NaN, an infinity or a sign would
    open as a silently wrong model."""
    values = t.detach().to(torch.float32)
    bad = None
    if bool(torch.isnan(values).any()):
        bad = "NaN"
    elif bool(torch.isinf(values).any()):
        bad = "infinite"
    elif bool((values < 0).any()):
        bad = "negative"
    elif positive and bool((values == 0).any()):
        bad = "zero"
    if bad is not None:
        raise UserError(f"{where}: tensor {name} holds {bad} values; a scale must be finite and "
                        f"{'positive' if positive else 'non-negative'}: the checkpoint is corrupt, "
                        "re-export it")


def scaled(q: Tensor, scale: Tensor, zp: Tensor | None, w: TensorScheme, where: str) -> Tensor:
    """(q - zero point) * scale with the scale spread over its tensor, channel, group or block."""
    if zp is not None and zp.shape != scale.shape:
        raise UserError(f"{where}: weight_zero_point of shape {list(zp.shape)} does not fit its "
                        f"weight_scale of shape {list(scale.shape)}")
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


def blockwise(codes: Tensor, scale: Tensor, block: int, where: str) -> Tensor:
    """FP4 codes times one scale per `block` elements along rows."""
    rows, cols = codes.shape
    if scale.shape != (rows, cols // block) or cols % block:
        raise UserError(f"{where}: weight_scale of shape {list(scale.shape)} does not fit blocks of "
                        f"{block} on a [{rows}, {cols}] weight")
    return (codes.reshape(rows, -1, block) * scale.unsqueeze(-1)).reshape(rows, cols)
