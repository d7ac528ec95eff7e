"""The fast Walsh-Hadamard transforms (formats/hadamard.py `fwht`, `butterfly`, the compiled
kernel `qf_fwht`) and the fused `rotate_fake_quantize`, against the dense reference `rotate`.

Tolerance, derived rather than tuned: every output of a block is a signed sum of its b inputs,
which the butterflies add in a binary tree of depth k = log2 b, then multiply once by
fl32(1/sqrt b) (itself within one rounding of 1/sqrt b). Each addition level and each of the two
roundings of the scale contributes at most one unit roundoff u = 2^-24 relative to the sum of
magnitudes, so |fwht(x) - exact| <= (k + 2) u sum|x_block| / sqrt b (first order; the test adds
1 %). The dense reference is a BLAS dot product of b terms with the rounded entries of H_b: at
most (b + 1) u sum|x_block| / sqrt b from the exact value. Exact = the same rotation in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize, fastpath
from qtransform.formats import hadamard as H

U = 2.0 ** -24
SETTINGS = settings(max_examples=40, deadline=None)


def exact(x: torch.Tensor, b: int, signs: torch.Tensor | None = None) -> torch.Tensor:
    """The rotation in float64 (exact to far below fp32 rounding for these sizes)."""
    xb = x.double().reshape(*x.shape[:-1], -1, b)
    if signs is not None:
        xb = xb * signs.double()
    return (xb @ H.hadamard_matrix(b, torch.float64)).reshape(x.shape)


def magnitude(x: torch.Tensor, b: int) -> torch.Tensor:
    """sum|x| of each element's block over sqrt(b), broadcast back to x's shape."""
    s = x.double().abs().reshape(*x.shape[:-1], -1, b).sum(-1, keepdim=True) / math.sqrt(b)
    return s.expand(*x.shape[:-1], -1, b).reshape(x.shape)


def fast_bound(x: torch.Tensor, b: int) -> torch.Tensor:
    return 1.01 * (int(math.log2(b)) + 2) * U * magnitude(x, b)


def dense_bound(x: torch.Tensor, b: int) -> torch.Tensor:
    return 1.01 * (b + 1) * U * magnitude(x, b)


@st.composite
def cases(draw):
    b = 2 ** draw(st.integers(0, 8))
    rows = draw(st.integers(1, 4))
    n = b * draw(st.integers(1, 4))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = 2.0 ** draw(st.integers(-20, 20))
    x = torch.randn(rows, n, generator=g) * scale
    signs = H.random_signs(b, draw(st.integers(0, 1000))) if draw(st.booleans()) else None
    return x, b, signs


@SETTINGS
@given(case=cases())
def test_fast_transform_equals_the_dense_reference(case, lib):
    x, b, signs = case
    fast = H.fwht(x, b, signs)
    assert torch.equal(fast, H.butterfly(x, b, signs))  # the compiled and torch butterflies
    err = (fast.double() - exact(x, b, signs)).abs()
    assert bool((err <= fast_bound(x, b)).all()), float((err / fast_bound(x, b)).max())
    ref = H.rotate(x, b, signs)
    assert bool(((fast.double() - ref.double()).abs() <= fast_bound(x, b) + dense_bound(x, b)).all())


@SETTINGS
@given(case=cases())
def test_applying_h_twice_is_the_identity(case, lib):
    """H is symmetric and orthonormal: H·H = I, so fwht(fwht(x)) = x; with signs D·H the
    inverse is H·D: transform without signs, then multiply by them."""
    x, b, signs = case
    once = H.fwht(x, b, signs)
    back = H.fwht(once, b)
    if signs is not None:
        back = (back.reshape(*x.shape[:-1], -1, b) * signs).reshape(x.shape)
    bound = fast_bound(x, b) + fast_bound(once, b)
    assert bool(((back.double() - x.double()).abs() <= bound).all())


@SETTINGS
@given(case=cases(), a=st.integers(-16, 16), c=st.integers(-16, 16))
def test_linear(case, a, c, lib):
    """H(a x + c y) = a H(x) + c H(y), coefficients multiples of 1/4 (exact scalings)."""
    x, b, signs = case
    a, c = a / 4, c / 4
    y = torch.flip(x, (0,)) * 0.5 + 1.0
    left = H.fwht(a * x + c * y, b, signs).double()
    right = a * H.fwht(x, b, signs).double() + c * H.fwht(y, b, signs).double()
    z = a * x + c * y
    bound = (fast_bound(z, b) + abs(a) * fast_bound(x, b) + abs(c) * fast_bound(y, b)
             + 2 * U * (z.double().abs().max() + (abs(a) * x.double().abs() + abs(c) * y.double().abs()).max()))
    assert bool(((left - right).abs() <= bound).all())


@pytest.mark.parametrize("b", [1, 4, 16, 64, 256])
def test_exact_where_every_step_is_exact(b, lib):
    """Small integers and a power-of-four block: every sum is an exact fp32 integer and the
    scale 2^-k is exact, so each path gives the exact rotation bit for bit."""
    x = torch.randint(-64, 65, (5, 2 * b), generator=torch.Generator().manual_seed(b)).float()
    signs = H.random_signs(b, 9)
    want = exact(x, b, signs).float()
    assert torch.equal(H.fwht(x, b, signs), want)
    assert torch.equal(H.butterfly(x, b, signs), want)
    assert torch.equal(H.rotate(x, b, signs), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [2, 8, 32, 128, 1024])
def test_compiled_kernel_is_the_butterfly_bit_for_bit(dtype, b, lib):
    """3-D input, every dtype the kernel reads (fp32 math, the result rounded to nearest even
    once), NaN and Inf propagated as the butterfly does."""
    g = torch.Generator().manual_seed(b)
    x = (torch.randn(3, 5, 2 * b, generator=g) * 30).to(dtype)
    x[0, 0, 0] = float("nan")
    x[1, 1, -1] = float("inf")
    signs = H.random_signs(b, 4)
    fast, slow = H.fwht(x, b, signs), H.butterfly(x, b, signs)
    assert fast.dtype == dtype and fast.shape == x.shape
    assert torch.equal(torch.isnan(fast), torch.isnan(slow))
    keep = ~torch.isnan(slow)
    assert torch.equal(fast[keep], slow[keep])
    assert bool(torch.isnan(fast[0, 0, :b]).all())  # a NaN spreads over its block only
    assert not bool(torch.isnan(fast[0, 0, b:]).any())


def test_without_the_kernel_the_butterfly_gives_the_same_bits(monkeypatch, lib):
    x = torch.randn(64, 512)
    with_kernel = H.fwht(x, 32, H.random_signs(32, 1))
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    assert fastpath.fwht(x, 32, None, H.scale_of(32)) is None
    assert torch.equal(H.fwht(x, 32, H.random_signs(32, 1)), with_kernel)


def test_input_untouched_and_gradient_is_the_dense_one(lib):
    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    before = x.detach().clone()
    signs = H.random_signs(16, 2)
    weight = torch.randn(4, 64)
    (H.fwht(x, 16, signs) * weight).sum().backward()
    fast_grad = x.grad.clone()
    x.grad = None
    (H.rotate(x, 16, signs) * weight).sum().backward()
    assert torch.equal(x.detach(), before)
    assert torch.allclose(fast_grad, x.grad, rtol=0, atol=float(fast_bound(weight, 16).max() * 4))


@pytest.mark.parametrize(("args", "match"), [
    ((torch.zeros(4, 24), 24), "power of two"),
    ((torch.zeros(4, 24), 16), "not a multiple of the block size 16"),
    ((torch.zeros(4, 32), 16, torch.ones(8)), r"signs must have shape \(16,\)"),
])
def test_bad_arguments_name_the_problem(args, match):
    with pytest.raises(ValueError, match=match):
        H.fwht(*args)


@pytest.mark.parametrize(("fmt", "opts"), [
    ("mxfp4", {}), ("mxfp4", {"scale_rule": "rceil"}), ("nvfp4", {}),
    ("mxfp4", {"rounding": "stochastic", "seed": 11}), ("mxfp8_e4m3", {}), ("int4", {}),
    ("mxfp4", {"block_shape": (32, 32), "granularity": "tile"}),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotate_fake_quantize_is_the_two_steps(fmt, opts, dtype, lib):
    """The in-place fused path (and the unfused one where it does not apply, 2-D tiles) equals
    fake_quantize of the rotated tensor bit for bit, and leaves the input untouched."""
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    x[:, 7] *= 40  # an outlier channel
    before = x.clone()
    signs = H.random_signs(32, 5)
    fused = H.rotate_fake_quantize(x, 32, signs, fmt, **opts)
    two_steps = fake_quantize(H.fwht(x, 32, signs), fmt, **opts)
    assert torch.equal(fused, two_steps) and torch.equal(x, before)


def test_fused_path_keeps_the_straight_through_gradient(lib):
    x = torch.randn(8, 64, requires_grad=True)
    H.rotate_fake_quantize(x, 32, None, "mxfp4").sum().backward()
    ones = torch.ones(8, 64)
    assert torch.allclose(x.grad, H.fwht(ones, 32), atol=1e-6)


def test_in_place_quantization_writes_the_same_bits(lib):
    """fastpath.quantize(out=x) (the fused path's second step) equals a fresh output."""
    from qtransform.formats.options import resolve
    from qtransform.formats.quantize import layout_for
    for fmt in ("mxfp4", "nvfp4", "mxfp8_e5m2"):
        x = torch.randn(96, 512) * torch.logspace(-4, 4, 96)[:, None]
        cfg = resolve(fmt)
        want = fake_quantize(x, cfg)
        y = x.clone()
        fastpath.quantize(y, cfg, layout_for(y, cfg), False, out=y)
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))
