"""The training references (tests/training_reference.py) against the stacks and the formats contract.

The reference of torchao's emulated MXFP8 training is checked against torchao itself (forward and
both gradients, torch.equal); the reference of Transformer Engine's NVFP4BlockScaling against
the formats' NVFP4 contract (TE's order of operations is NUMERICS.md's default) and TE's own
Hadamard construction. The preset tests then compare qtransform's training with these.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize, hadamard, philox
from tests import training_reference as ref


def operands(seed: int, tokens: int = 64, inp: int = 96, out: int = 128, spread: float = 3.0):
    """x, w, g with magnitudes spread over `spread` decades along each axis (outlier columns)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inp, generator=gen) * torch.logspace(-spread / 2, spread / 2, inp)
    w = torch.randn(out, inp, generator=gen) * 0.05
    g = torch.randn(tokens, out, generator=gen) * torch.logspace(-4, -2, out)
    return x, w, g


@pytest.mark.parametrize("wgrad_with_hp", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torchao_emulated_mxfp8_training_is_the_reference(seed, wgrad_with_hp):
    """torchao's mx_mm (EMULATED) quantizes each operand from high precision along its GEMM's
    reduction axis: forward, dgrad and wgrad equal the reference bit for bit."""
    x, w, g = operands(seed)
    ours = ref.torchao_mxfp8_linear(x, w, g, wgrad_with_hp)
    theirs = ref.torchao_emulated_mxfp8(x, w, g, wgrad_with_hp)
    assert torch.equal(theirs.y, ours.y)
    assert torch.equal(theirs.dx, ours.dx)
    assert torch.equal(theirs.dw, ours.dw)
    # the quantized backward differs from the straight-through one: the check has teeth
    assert not torch.equal(ours.dx, g @ ref.mxfp8(w))
    if not wgrad_with_hp:
        assert not torch.equal(ours.dw, g.T @ x)


def test_mxfp8_reference_is_the_formats_rceil():
    x, w, _ = operands(3, spread=8.0)
    for t in (x, w, w.T.contiguous()):
        assert torch.equal(ref.mxfp8(t), fake_quantize(t, "mxfp8_e4m3", block_size=32, scale_rule="rceil"))


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_te_nvfp4_reference_is_the_formats_default_order(tile):
    """TE's reference quantizer computes NUMERICS.md's default NVFP4 order; its 16x16 weight tiles
    are the formats' block_shape (16, 16)."""
    x, w, _ = operands(4, spread=6.0)
    for t in (x, w):
        options = {"block_shape": tile} if tile == (16, 16) else {}
        assert torch.equal(ref.nvfp4(t, tile), fake_quantize(t, "nvfp4", **options))


def test_te_nvfp4_stochastic_reference_uses_the_contract_draws():
    x, _, _ = operands(5)
    u = philox.uniform_at(11, philox.positions(tuple(x.shape)))
    assert torch.equal(ref.nvfp4(x, u=u), fake_quantize(x, "nvfp4", rounding="stochastic", seed=11))
    assert not torch.equal(ref.nvfp4(x, u=u), ref.nvfp4(x))


def test_te_rht_is_the_shared_rotation_with_te_signs():
    x, _, _ = operands(6)
    signs = torch.tensor(ref.TE_RHT_SIGNS, dtype=torch.float32)
    assert torch.equal(ref.te_rht(x), hadamard.rotate(x, 16, signs))
    h = ref.te_rht(torch.eye(16))
    torch.testing.assert_close(h @ h.T, torch.eye(16), rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.0, 6.0, allow_nan=False, width=32))
def test_e2m1_stochastic_rounding_is_unbiased(a):
    u = (torch.arange(4096, dtype=torch.float32) + 0.5) / 4096  # a uniform grid of draws
    out = ref.e2m1_stochastic(torch.full((4096,), a), u)
    assert abs(out.mean().item() - a) <= 1e-3 * max(a, 1.0)
    assert set(out.unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def test_te_switches_change_what_they_say():
    """Each switch of the reference changes only its own part of the backward."""
    x, w, g = operands(7)
    gen = torch.Generator().manual_seed(0)
    u_d, u_w = torch.rand(g.shape, generator=gen), torch.rand(g.T.shape, generator=gen)
    base = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(), u_d, u_w)
    hp = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(backward_override="high_precision"))
    deq = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(backward_override="dequantized"))
    assert torch.equal(hp.y, base.y) and torch.equal(deq.y, base.y)
    assert torch.equal(hp.dx, g @ w) and torch.equal(hp.dw, g.T @ x)
    assert torch.equal(deq.dx, g @ ref.nvfp4(w, (16, 16))) and torch.equal(deq.dw, g.T @ ref.nvfp4(x))
    no_rht = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(disable_rht=True), u_d, u_w)
    assert torch.equal(no_rht.dx, base.dx) and not torch.equal(no_rht.dw, base.dw)
    no_sr = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(disable_stochastic_rounding=True), u_d, u_w)
    assert not torch.equal(no_sr.dx, base.dx) and not torch.equal(no_sr.dw, base.dw)
    one_d = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(disable_2d_quantization=True), u_d, u_w)
    assert not torch.equal(one_d.y, base.y) and torch.equal(one_d.dw, base.dw)
    # the quantized wgrad estimates the true one: RHT + stochastic rounding, averaged over draws
    exact = g.T @ x
    mean = sum(ref.te_nvfp4_linear(x, w, g, ref.TESwitches(backward_override=None),
                                   torch.rand(g.shape, generator=gen), torch.rand(g.T.shape, generator=gen)).dw
               for _ in range(64)) / 64
    assert (mean - exact).norm() < (no_sr.dw - exact).norm()
