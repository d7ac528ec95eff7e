"""Noise kinds: the registry of noise formulas, each in every form qtransform runs it.

A *noise kind* is one formula y = f(x, z, scale) with the distribution of its draw z. The kind is
everything the rest of qtransform needs to know about a formula: the `qtransform::noise` custom
op computes it and its gradient (`core/ops.py`), the ONNX export writes its body and, in
`noise="random"` mode, its draw (`export/graph.py`), and a noise module (`core/noise.py`) draws z
with it. Nothing outside this registry switches on a kind's name, so a new kind is one
`register_noise_kind` call; one that lacks a part fails at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

Draw = Literal["normal", "uniform"]
DRAWS: tuple[str, ...] = ("normal", "uniform")


class OnnxBuilder(Protocol):
    """What a kind's ONNX form may use (the export layer implements it): standard ONNX ops on
    named values, fp32 constants, and PyTorch's rounding of an intermediate to x's dtype. The
    inputs are "X" (the value noised) and "Z" (the draw, fp32); the form returns its fp32 result,
    which the export casts to X's dtype."""

    def op(self, op_type: str, *inputs: str, **attrs: object) -> str: ...

    def const(self, value: ArrayLike) -> str: ...

    def as_float(self, value: str) -> str: ...

    def rounded(self, value: str) -> str: ...


@dataclass(frozen=True)
class NoiseKind:
    """One noise formula, in every form qtransform runs it.

    `apply(x, z, scale)` is the eager and custom-op result (z arrives in fp32); `grad(grad, z,
    scale)` is dy/dx times the incoming gradient; `onnx(builder, scale)` writes the same
    arithmetic as ONNX ops, bit for bit; `draw` is the distribution of z; `neutral` is a draw
    value that leaves x unchanged at any scale (a graph input filled with it disables the
    noise), or None when no draw does (then only scale 0 or `noise="off"` does).
    `apply_fresh`, where given, is `apply` bit for bit that may overwrite z (a fresh draw no one
    else holds): a forward then allocates one tensor instead of one per operation.
    `apply_inplace`, where given, is `apply` bit for bit written into x (a value no one else
    holds, `NoiseModule.owns_input`) that may overwrite z: no output buffer at all."""

    name: str
    formula: str  # in words, for docs and errors: "x + s*z"
    apply: Callable[[Tensor, Tensor, float], Tensor]
    grad: Callable[[Tensor, Tensor, float], Tensor]
    onnx: Callable[[OnnxBuilder, float], str]
    draw: Draw
    neutral: float | None
    apply_fresh: Callable[[Tensor, Tensor, float], Tensor] | None = None
    apply_inplace: Callable[[Tensor, Tensor, float], Tensor] | None = None

    def __post_init__(self) -> None:
        missing = [part for part in ("apply", "grad", "onnx") if not callable(getattr(self, part))]
        if missing:
            raise TypeError(f"noise kind {self.name!r} lacks {', '.join(missing)}: a kind is its eager "
                            "formula, its gradient and its ONNX form together")
        if self.draw not in DRAWS:
            raise ValueError(f"noise kind {self.name!r}: draw {self.draw!r} is not one of {', '.join(DRAWS)}")
        if not self.name.isidentifier():
            raise ValueError(f"noise kind name {self.name!r} must be an identifier")


_KINDS: dict[str, NoiseKind] = {}


def register_noise_kind(kind: NoiseKind) -> NoiseKind:
    """Add a formula to the registry the op, the export and the modules read."""
    if kind.name in _KINDS:
        raise ValueError(f"noise kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def noise_kind(name: str) -> NoiseKind:
    if name not in _KINDS:
        raise ValueError(f"unknown noise kind {name!r}; registered: {', '.join(_KINDS)}")
    return _KINDS[name]


def noise_kinds() -> tuple[NoiseKind, ...]:
    return tuple(_KINDS.values())


# -- the built-in kinds -----------------------------------------------------------------------------
def _add(x: Tensor, z: Tensor, scale: float) -> Tensor:
    return x + scale * z.to(x.dtype)


def _relative(x: Tensor, z: Tensor, scale: float) -> Tensor:
    return x * (1 + scale * z.to(x.dtype))


def _add_fresh(x: Tensor, z: Tensor, scale: float) -> Tensor:
    z = z.to(x.dtype)  # a copy when the dtypes differ: z is fresh either way
    return x + z.mul_(scale)


def _relative_fresh(x: Tensor, z: Tensor, scale: float) -> Tensor:
    z = z.to(x.dtype)
    return x * z.mul_(scale).add_(1)


def _add_inplace(x: Tensor, z: Tensor, scale: float) -> Tensor:
    return x.add_(z.to(x.dtype).mul_(scale))


def _relative_inplace(x: Tensor, z: Tensor, scale: float) -> Tensor:
    return x.mul_(z.to(x.dtype).mul_(scale).add_(1))


def _relative_grad(grad: Tensor, z: Tensor, scale: float) -> Tensor:
    return grad * (1 + scale * z.to(grad.dtype))


def _z_like_x(b: OnnxBuilder) -> str:
    return b.rounded(b.as_float("Z"))  # z.to(x.dtype), carried in fp32


def _add_onnx(b: OnnxBuilder, scale: float) -> str:
    return b.op("Add", b.as_float("X"), b.rounded(b.op("Mul", _z_like_x(b), b.const(scale))))


def _relative_onnx(b: OnnxBuilder, scale: float) -> str:
    sz = b.rounded(b.op("Mul", _z_like_x(b), b.const(scale)))
    return b.op("Mul", b.as_float("X"), b.rounded(b.op("Add", sz, b.const(1.0))))


register_noise_kind(NoiseKind("add", "x + s*z", _add, lambda grad, z, scale: grad, _add_onnx,
                              draw="normal", neutral=0.0, apply_fresh=_add_fresh,
                              apply_inplace=_add_inplace))
register_noise_kind(NoiseKind("relative", "x*(1 + s*z)", _relative, _relative_grad, _relative_onnx,
                              draw="normal", neutral=0.0, apply_fresh=_relative_fresh,
                              apply_inplace=_relative_inplace))
