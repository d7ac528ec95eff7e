"""The counter-based Gaussian stream (formats/philox.py): the compiled kernel and the torch version
give the same bits (draws and fused application), and the draws are standard normal and
independent."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fastpath, philox


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), n=st.integers(1, 3000))
def test_the_kernels_draws_are_the_torch_versions_bit_for_bit(lib, seed, n):
    assert torch.equal(_bits(fastpath.normal(seed, (n,))), _bits(philox.normal(seed, (n,))))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), n=st.integers(1, 2000), scale=st.floats(1e-4, 2.0),
       op=st.sampled_from(["add", "relative"]))
def test_the_fused_draw_and_formula_are_the_torch_formula_on_the_draw_bit_for_bit(lib, seed, n, scale, op):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000)) * 3
    z = philox.normal(seed, (n,))
    want = x + scale * z if op == "add" else x * (1 + scale * z)  # the noise kinds' torch order
    assert torch.equal(_bits(fastpath.normal(seed, (n,), x, op, scale)), _bits(want))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), positions=st.lists(st.integers(0, 2**40), min_size=1, max_size=64))
def test_a_draw_depends_on_its_position_only(seed, positions):
    """Any positions, in any order, far into the stream: each is the stream's element there."""
    pos = torch.tensor(positions)
    got = philox.normal_at(seed, pos)
    for p, g in zip(positions, got, strict=True):
        assert _bits(g) == _bits(philox.normal_at(seed, torch.tensor([p])))[0]
    lo = min(positions)
    run = philox.normal_at(seed, torch.arange(lo, lo + 8))
    assert torch.equal(_bits(philox.normal_at(seed, torch.arange(lo, lo + 8).flip(0))), _bits(run.flip(0)))


def test_the_thread_count_changes_no_draw(lib):
    n = 1 << 18  # above the kernel's parallel threshold
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fastpath.normal(11, (n,))
        torch.set_num_threads(2)
        two = fastpath.normal(11, (n,))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(one), _bits(two))


def test_the_stream_is_a_standard_normal():
    """Mean, variance, tails and a Kolmogorov-Smirnov test at 4M draws (critical values at a
    false-alarm rate of about 1e-3)."""
    n = 1 << 22
    z = philox.normal(2026, (n,)).double()
    assert abs(z.mean().item()) < 3.3 * math.sqrt(1 / n)
    assert abs(z.var().item() - 1) < 3.3 * math.sqrt(2 / n)
    assert abs(((z**4).mean() - 3).item()) < 0.02  # kurtosis of a normal
    assert z.abs().max().item() <= math.sqrt(-2 * math.log(2.0**-24)) + 1e-5  # |z| <= 5.77
    ks = ((torch.arange(1, n + 1, dtype=torch.float64) / n) - torch.special.ndtr(z.sort().values)).abs().max()
    assert ks.item() < 1.95 / math.sqrt(n)


def test_streams_and_neighbours_are_independent():
    """Correlations between two seeds, between neighbouring elements (the two halves of a
    Box-Muller pair, the two pairs of a counter, adjacent counters) and between z and z^2 of a
    neighbour, all within 4.5 standard errors of 0."""
    n = 1 << 20
    a, b = philox.normal(1, (n,)).double(), philox.normal(2, (n,)).double()
    bound = 4.5 / math.sqrt(n // 4)

    def corr(u, v):
        u, v = u - u.mean(), v - v.mean()
        return ((u * v).mean() / (u.std() * v.std())).item()

    assert abs(corr(a, b)) < bound
    for lag in (1, 2, 3, 4, 5):
        assert abs(corr(a[:-lag], a[lag:])) < bound
        assert abs(corr(a[:-lag] ** 2, a[lag:] ** 2)) < bound
    pairs = a.reshape(-1, 2)
    assert abs(corr(pairs[:, 0] ** 2, pairs[:, 1] ** 2)) < bound
