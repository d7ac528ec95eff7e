"""Rotations of a tensor's axis per block: the numerics of the rotate pass and its op.

A rotation is described by one operand tensor: the b signs of a Walsh-Hadamard kind (all +1 for
plain `hadamard`, the Philox signs of a seed for `random_hadamard`), or the b×b matrix of kind
`matrix`. Applied along an axis, block by block of b consecutive elements: (x·diag(s))·H_b, or
x·M.

The Hadamard kinds run the butterfly (`walsh_hadamard`): signs first, then per stage h = 1, 2,
.., b/2 the pairs h apart become (a + c, a − c), then one multiplication by fl32(1/√b), all in
fp32. That order is the contract the ONNX body repeats op for op (bit for bit in onnxruntime) and
the fast kernels of `formats.hadamard` follow; it equals the dense reference `hadamard.rotate` up
to fp32 rounding. A matrix is one fp32 matmul per block (its summation order is the runtime's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qtransform.formats import hadamard


def hadamard_scale(block: int) -> float:
    """fl32(1/sqrt(b)): the one multiplication the butterfly ends with."""
    return hadamard.scale_of(block)


def walsh_hadamard(x: Tensor, signs: Tensor) -> Tensor:
    """(x·diag(signs))·H_b/√b per block of b = len(signs) along the last axis, in the butterfly
    order above (fp32 inside, x's dtype out): `formats.hadamard.fwht`, the compiled kernel on
    CPU, Triton on CUDA, the torch butterfly elsewhere (the same bits on each)."""
    return hadamard.fwht(x, signs.shape[0], signs)


def rotation_operand(kind: str, block: int, seed: int = 0, matrix: Tensor | None = None) -> Tensor:
    """The operand of a rotation kind (float32): signs [b] for the Hadamard kinds, the matrix
    [b, b] for kind matrix."""
    if kind == "matrix":
        if matrix is None:
            raise ValueError("kind 'matrix' needs its matrix")
        return matrix.to(torch.float32)
    if kind == "random_hadamard":
        return hadamard.random_signs(block, seed)
    if kind != "hadamard":
        raise ValueError(f"unknown rotation kind {kind!r}")
    return torch.ones(block, dtype=torch.float32)


def apply_rotation(x: Tensor, operand: Tensor, axis: int = -1) -> Tensor:
    """x rotated along `axis` per block of the operand's size; computed in float32, returned in
    x's dtype. The axis must be a multiple of the block."""
    moved = axis not in (-1, x.dim() - 1)
    if moved:
        x = x.movedim(axis, -1)
    if operand.dim() == 1:
        out = walsh_hadamard(x, operand)
    else:
        b, n = operand.shape[0], x.shape[-1]
        if n % b:
            raise ValueError(f"axis of {n} is not a multiple of the block size {b}")
        blocks = x.to(torch.float32).reshape(*x.shape[:-1], n // b, b)
        out = (blocks @ operand.to(x.device, torch.float32)).reshape(x.shape).to(x.dtype)
    return out.movedim(-1, axis) if moved else out


def unrotate(x: Tensor, operand: Tensor, axis: int = -1) -> Tensor:
    """The inverse (transpose) rotation: x·Mᵀ per block, or (x·H_b)·diag(signs) (H symmetric):
    gradients of a rotation, and the input an engine gets back from rotated weights."""
    if operand.dim() == 2:
        return apply_rotation(x, operand.T.contiguous(), axis)
    moved = x.movedim(axis, -1)
    b = operand.shape[0]
    out = apply_rotation(moved, torch.ones_like(operand))
    out = (out.reshape(*out.shape[:-1], -1, b) * operand.to(out.device, out.dtype)).reshape(moved.shape)
    return out.movedim(-1, axis)
