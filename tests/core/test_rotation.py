"""Properties of the rotations (core/rotation.py, the `qtransform::rotate` op), by hypothesis.

R is read back from the code as the rotation of the identity matrix's rows; the references are
scipy's Hadamard matrix in float64 and the definitions (orthogonal, H symmetric involution,
block-diagonal)."""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.core.rotation import apply_rotation, rotation_operand, unrotate, walsh_hadamard
from qtransform.formats import hadamard

BLOCKS = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256])
KINDS = st.sampled_from(["hadamard", "random_hadamard"])
SEEDS = st.integers(0, 2**31)


def _matrix(kind: str, b: int, seed: int) -> torch.Tensor:
    """R as the code applies it: row i is e_i rotated."""
    return apply_rotation(torch.eye(b), rotation_operand(kind, b, seed))


def _x(seed: int, rows: int, n: int) -> torch.Tensor:
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=40, deadline=None)
@given(kind=KINDS, b=BLOCKS, seed=SEEDS)
def test_r_is_orthogonal_and_equals_the_documented_matrix(kind, b, seed):
    r = _matrix(kind, b, seed).double()
    torch.testing.assert_close(r @ r.T, torch.eye(b, dtype=torch.float64), rtol=0, atol=1e-6)
    h = torch.from_numpy(scipy.linalg.hadamard(b).astype(np.float64)) / np.sqrt(b)
    signs = hadamard.random_signs(b, seed).double() if kind == "random_hadamard" else torch.ones(b, dtype=torch.float64)
    assert set(signs.tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(r, signs[:, None] * h, rtol=0, atol=1e-7)


@settings(max_examples=40, deadline=None)
@given(b=BLOCKS, blocks=st.integers(1, 4), seed=SEEDS)
def test_hadamard_twice_is_the_identity(b, blocks, seed):
    x = _x(seed, 3, b * blocks)
    ones = rotation_operand("hadamard", b)
    twice = apply_rotation(apply_rotation(x, ones), ones)
    torch.testing.assert_close(twice, x, rtol=0, atol=4e-6 * float(x.abs().max()) * max(1, np.log2(b)))
    signs = rotation_operand("random_hadamard", b, seed)
    back = unrotate(apply_rotation(x, signs), signs)
    torch.testing.assert_close(back, x, rtol=0, atol=4e-6 * float(x.abs().max()) * max(1, np.log2(b)))


@settings(max_examples=40, deadline=None)
@given(kind=KINDS, b=BLOCKS, blocks=st.integers(2, 5), which=st.integers(0, 4), seed=SEEDS)
def test_blocks_are_independent_bit_for_bit(kind, b, blocks, which, seed):
    which %= blocks
    x = _x(seed, 2, b * blocks)
    y = x.clone()
    y[:, which * b:(which + 1) * b] = _x(seed + 1, 2, b)
    op = rotation_operand(kind, b, seed)
    rx, ry = apply_rotation(x, op), apply_rotation(y, op)
    keep = torch.ones(b * blocks, dtype=torch.bool)
    keep[which * b:(which + 1) * b] = False
    assert torch.equal(rx[:, keep], ry[:, keep])
    assert torch.equal(ry[:, ~keep], apply_rotation(y[:, ~keep], op))  # a block alone: the same bits


@settings(max_examples=40, deadline=None)
@given(kind=KINDS, b=BLOCKS, seed=SEEDS, axis=st.sampled_from([0, 1, -1]))
def test_the_butterfly_equals_the_dense_reference_to_rounding_along_any_axis(kind, b, seed, axis):
    x = _x(seed, 2 * b, 2 * b)
    op = rotation_operand(kind, b, seed)
    got = apply_rotation(x, op, axis)
    moved = x.movedim(axis, -1)
    dense = torch.block_diag(*[_matrix(kind, b, seed).double()] * 2)
    want = (moved.double() @ dense).movedim(-1, axis)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * float(x.abs().max()) * max(1, np.log2(b)))
    ref = hadamard.rotate(moved, b, op).movedim(-1, axis)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-6 * float(x.abs().max()) * max(1, np.log2(b)))


@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["hadamard", "random_hadamard", "matrix"]), seed=SEEDS)
def test_the_op_gradient_is_the_transposed_rotation(kind, seed):
    b = 16
    matrix = torch.linalg.qr(torch.randn(b, b, generator=torch.Generator().manual_seed(seed)))[0]
    op = rotation_operand(kind, b, seed, matrix if kind == "matrix" else None)
    x = _x(seed, 3, 2 * b).requires_grad_()
    g = _x(seed + 7, 3, 2 * b)
    torch.ops.qtransform.rotate(x, op, kind, "t").backward(g)
    dense = torch.block_diag(*[apply_rotation(torch.eye(b), op).double()] * 2)
    torch.testing.assert_close(x.grad.double(), g.double() @ dense.T, rtol=0, atol=1e-5)


def test_bf16_inputs_are_rotated_in_fp32_and_rounded_once():
    x = _x(3, 4, 64).to(torch.bfloat16)
    signs = rotation_operand("random_hadamard", 32, 5)
    got = walsh_hadamard(x, signs)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, walsh_hadamard(x.float(), signs).to(torch.bfloat16))
