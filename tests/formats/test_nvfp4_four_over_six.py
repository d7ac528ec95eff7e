"""NVFP4 four over six: per block the better of the max/6 and max/4 scales (docs/numerics.md).

Properties (hypothesis) of the reference path, the C kernel equal to it bit for bit, and
separating vectors whose choice is asserted: a tie, a max/4 scale that E4M3 saturates at bound
448, and a near-tie that MSE and MAE decide differently.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize, fastpath
from qtransform.formats.nvfp4 import block_error
from qtransform.formats.quantize import quantize_with_info

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def reference(x: torch.Tensor, **opts) -> torch.Tensor:
    """The torch reference path (the fast path switched off for the call)."""
    old = os.environ.get("QTRANSFORM_FASTPATH")
    os.environ["QTRANSFORM_FASTPATH"] = "0"
    try:
        return fake_quantize(x, "nvfp4", **opts)
    finally:
        if old is None:
            del os.environ["QTRANSFORM_FASTPATH"]
        else:
            os.environ["QTRANSFORM_FASTPATH"] = old


def errors(out: torch.Tensor, x: torch.Tensor, mode: str) -> torch.Tensor:
    """Each 16-block's error as the format defines it."""
    return block_error(out.reshape(-1, 16).float(), x.reshape(-1, 16).float(), mode)


finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
tensors = st.tuples(st.lists(finite, min_size=64, max_size=64),
                    st.integers(-30, 30)).map(lambda v: torch.tensor(v[0]).reshape(4, 16) * 2.0 ** v[1])


@settings(max_examples=150, deadline=None)
@given(tensors, st.sampled_from(["mse", "mae"]))
def test_chosen_block_is_never_worse_than_max6(x, mode):
    """At bound 448 every block's error (as defined) is at most the plain NVFP4 block's, for the
    metric chosen by, and each block equals one of the two candidates."""
    plain = reference(x)
    fos = reference(x, four_over_six=mode)
    assert (errors(fos, x, mode) <= errors(plain, x, mode)).all()
    same = (fos.reshape(-1, 16) == plain.reshape(-1, 16)).all(dim=1)
    changed = ~same
    if changed.any():  # a changed block is strictly better
        assert (errors(fos, x, mode)[changed] < errors(plain, x, mode)[changed]).all()


@settings(max_examples=60, deadline=None)
@given(tensors)
def test_without_the_option_nvfp4_is_unchanged(x):
    """four_over_six "none" and global_bound 448 are the plain NVFP4 bits (and the options stay
    out of the config's numerics, so plans and ONNX attributes are unchanged)."""
    plain = reference(x)
    assert torch.equal(reference(x, four_over_six="none", global_bound=448).view(torch.int32),
                       plain.view(torch.int32))
    from qtransform.formats.options import resolve

    assert resolve("nvfp4", four_over_six="none").numerics() == resolve("nvfp4").numerics()
    assert resolve("nvfp4", four_over_six="mae").numerics()["four_over_six"] == "mae"


@pytest.mark.skipif(fastpath.unavailable_reason() is not None, reason="no C fast path here")
@settings(max_examples=60, deadline=None)
@given(tensors, st.sampled_from(["mse", "mae"]), st.sampled_from([448, 256]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["rne", "rna", "stochastic"]))
def test_c_kernel_equals_reference(x, mode, bound, dtype, rounding):
    x = x.to(dtype)
    opts = {"four_over_six": mode, "global_bound": bound, "rounding": rounding}
    if rounding == "stochastic":
        opts["seed"] = 5
    fast = fake_quantize(x, "nvfp4", **opts)
    assert torch.equal(fast.view(BITS[dtype]), reference(x, **opts).view(BITS[dtype]))


def test_c_kernel_on_awkward_shapes_and_specials():
    """Ragged rows, blocks along axis 0, NaN / Inf / subnormal blocks, 4-D activations."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 70, generator=g) * torch.logspace(-6, 6, 9)[:, None]
    x[1, 3], x[2, 20], x[3] = float("nan"), float("inf"), x[3] * 1e-39
    for opts in ({"axis": -1}, {"axis": 0}):
        for mode in ("mse", "mae"):
            want = reference(x, four_over_six=mode, **opts)
            got = fake_quantize(x, "nvfp4", four_over_six=mode, **opts)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    a = torch.randn(2, 3, 5, 32, generator=g)
    assert torch.equal(fake_quantize(a, "nvfp4", four_over_six="mse").view(torch.int32),
                       reference(a, four_over_six="mse").view(torch.int32))


def with_info(x: torch.Tensor, fast: bool, **opts) -> tuple[torch.Tensor, torch.Tensor]:
    """(values as bits, saturation mask) from the fast path or the reference path."""
    old = os.environ.get("QTRANSFORM_FASTPATH")
    os.environ["QTRANSFORM_FASTPATH"] = "1" if fast else "0"
    try:
        out, sat, _ = quantize_with_info(x, "nvfp4", **opts)
    finally:
        if old is None:
            del os.environ["QTRANSFORM_FASTPATH"]
        else:
            os.environ["QTRANSFORM_FASTPATH"] = old
    return out.view(BITS[x.dtype]), sat


def vector_rows(seed: int, rows: int, blocks: int, size: int, scale: int, kind: str) -> torch.Tensor:
    """rows x (blocks * size) fp32 values: whole blocks, the C kernel's vector path (16 blocks at
    a time, so 17 or 33 blocks leave a partial group). kind "grid": values on or halfway between
    both candidates' grids (ties in the errors and in the rounding); "wide": every block another
    scale, subnormal and huge ones among them."""
    g = torch.Generator().manual_seed(seed)
    n = blocks * size
    if kind == "grid":
        grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5,
                             3.75, 4.0, 4.5, 5.0, 6.0])
        x = grid[torch.randint(len(grid), (rows, n), generator=g)]
        x = x * torch.where(torch.rand(rows, n, generator=g) < 0.5, -1.0, 1.0)
        x[:, ::size] = 6.0  # every block's amax 6: scales 1 and 1.5 under amax=2688
    else:
        x = torch.randn(rows, n, generator=g)
        x = x * 2.0 ** torch.randint(-140, 100, (rows, blocks, 1), generator=g).repeat(1, 1, size).reshape(rows, n)
    return x * 2.0**scale


@pytest.mark.skipif(fastpath.unavailable_reason() is not None, reason="no C fast path here")
@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 3), st.sampled_from([1, 16, 17, 33]),
       st.sampled_from([16, 32, 64]), st.integers(-20, 20), st.sampled_from(["grid", "wide"]),
       st.sampled_from(["mse", "mae"]), st.sampled_from([448, 256]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       st.sampled_from(["rne", "rna", "stochastic"]), st.booleans())
def test_vector_path_equals_reference(seed, rows, blocks, size, scale, kind, mode, bound, dtype,
                                      rounding, given_amax):
    """Rows of whole blocks (the kernel's vector path): values and saturation bit for bit, with
    the tensor amax from x or given (then grid values meet scales 1 and 1.5 exactly)."""
    x = vector_rows(seed, rows, blocks, size, scale if kind == "wide" else 0, kind).to(dtype)
    opts = {"four_over_six": mode, "global_bound": bound, "rounding": rounding, "block_size": size}
    if rounding == "stochastic":
        opts["seed"] = seed
    if given_amax:
        opts["amax"] = torch.tensor(2688.0 if kind == "grid" else 2.0**scale)
    fast, ref = with_info(x, True, **opts), with_info(x, False, **opts)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


@pytest.mark.skipif(fastpath.unavailable_reason() is not None, reason="no C fast path here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vector_path_special_blocks(dtype):
    """Rows of 17 blocks under a given tensor amax (so a NaN stays in its block): a NaN block, an
    Inf block, a zero block, a subnormal block, blocks past the 448 and 256 bounds, and a tie,
    each in a group with ordinary blocks whose choice differs."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 17 * 16, generator=g)
    x[0, 5], x[1, 40], x[1, 41] = float("nan"), float("inf"), -float("inf")
    x[2, 16:32], x[2, 32:48] = 0.0, torch.randn(16, generator=g) * 1e-40
    x[3, :16] = torch.tensor([6.0, -6.0] * 8)  # a tie at error 0
    x[3, 16:32] = torch.tensor([6.0] + [4.5] * 15)  # max/4 exact
    x[3, 48:64] *= 1e4  # past the tensor amax: both scales saturate
    for amax in (torch.tensor(6.0), torch.tensor(2688.0)):
        for mode in ("mse", "mae"):
            for bound in (448, 256):
                opts = {"four_over_six": mode, "global_bound": bound, "amax": amax}
                xd = x.to(dtype)
                fast, ref = with_info(xd, True, **opts), with_info(xd, False, **opts)
                assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1]), (amax, mode, bound)
    both = with_info(x, True, four_over_six="mse", amax=torch.tensor(2688.0))[0].view(torch.float32)
    assert torch.equal(both[3, 16:32], x[3, 16:32])  # the max/4 block came back exactly
    assert both[0, :16].isnan().all() and not both[0, 16:].isnan().any()


def keeps_max4(x: torch.Tensor, **opts) -> torch.Tensor:
    """Per 16-block of x, whether the reference path keeps its max/4 candidate."""
    plain = reference(x, **{k: v for k, v in opts.items() if k != "four_over_six"})
    return (reference(x, **opts) != plain).reshape(-1, 16).any(dim=1)


def boundary_blocks(mode: str, opts: dict) -> torch.Tensor:
    """Blocks on the reference's decision boundary: element 1 of random blocks (amax 1) swept
    over (0, 1), then bisected on its bit pattern to two neighbouring floats that the reference
    decides differently (the two errors within an ulp or so of each other); both sides."""
    g = torch.Generator().manual_seed(7)
    blocks = torch.rand(256, 16, generator=g) * 2 - 1
    blocks[:, 0] = 1.0
    sweep = torch.linspace(0.01, 1.0, 65)

    def decide(values: torch.Tensor) -> torch.Tensor:
        b = blocks[: len(values)].clone()
        b[:, 1] = values
        return keeps_max4(b, four_over_six=mode, **opts)

    seen = torch.stack([decide(torch.full((256,), float(t))) for t in sweep], dim=1)
    flips = (seen[:, 1:] != seen[:, :1]).int().argmax(dim=1)
    has = (seen[:, 1:] != seen[:, :1]).any(dim=1)
    blocks = blocks[has]
    lo = sweep[flips[has]].view(torch.int32).clone()
    hi = sweep[flips[has] + 1].view(torch.int32).clone()
    first = decide(lo.view(torch.float32))
    while (hi - lo > 1).any():
        mid = lo + (hi - lo) // 2
        same = decide(mid.view(torch.float32)) == first
        lo, hi = torch.where(same, mid, lo), torch.where(same, hi, mid)
    out = []
    for side in (lo, hi):
        b = blocks.clone()
        b[:, 1] = side.view(torch.float32)
        out.append(b)
    return torch.cat(out)


@pytest.mark.skipif(fastpath.unavailable_reason() is not None, reason="no C fast path here")
@pytest.mark.parametrize("mode", ["mse", "mae"])
def test_vector_path_sums_in_the_halving_order(mode):
    """Blocks on the decision boundary, in rows of 16 whole blocks: the vector path decides each
    as the reference does, which a summation order other than the halving one would not."""
    opts = {"global_bound": 256, "amax": torch.tensor(1.3)}
    x = boundary_blocks(mode, opts)
    assert len(x) >= 64
    x = x[: len(x) // 16 * 16].reshape(-1, 256)
    fast, ref = with_info(x, True, four_over_six=mode, **opts), with_info(x, False, four_over_six=mode, **opts)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])
    four = keeps_max4(x, four_over_six=mode, **opts)
    assert four.any() and not four.all()


def block(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(1, 16)


def chosen_scale(x: torch.Tensor, **opts) -> str:
    """Which candidate fake_quantize kept for a single-block tensor: '6' when its values are the
    plain NVFP4 ones, else '4'."""
    out = fake_quantize(x, "nvfp4", **opts)
    six = fake_quantize(x, "nvfp4", **{k: v for k, v in opts.items() if k != "four_over_six"})
    if torch.equal(out, six):
        return "6"
    return "4"


# the tensor amax is given (amax=) so g is fixed: block amax 6 with tensor amax 2688 gives
# g = 1, max/6 scale e4m3(1) = 1 and max/4 scale e4m3(1.5) = 1.5
G1 = torch.tensor(2688.0)


def test_a_tie_keeps_max6():
    """All elements at +-amax: both candidates reconstruct exactly (error 0 and 0)."""
    x = block([6.0, -6.0] * 8)
    for mode in ("mse", "mae"):
        assert chosen_scale(x, four_over_six=mode, amax=G1) == "6"
        out = fake_quantize(x, "nvfp4", four_over_six=mode, amax=G1)
        assert torch.equal(out, x)
    # a tie with a non-zero error: 6 and 1.5 round the same under both scales (1.5 = 1 * 1.5, and
    # 6 * 4/6 = 4 exactly), so equal errors keep the max/6 block
    x = block([6.0, 1.5] + [0.0] * 14)
    assert torch.equal(errors(fake_quantize(x, "nvfp4", amax=G1), x, "mse"), torch.tensor([0.0]))


def test_max4_wins_where_the_max6_grid_is_coarse():
    """Values at 3 * 1.5 = 4.5 are exact on the max/4 grid (scale 1.5: 4.5 = 3 * 1.5) and not on
    the max/6 grid (scale 1: 4.5 rounds to 4): both metrics choose max/4."""
    x = block([6.0] + [4.5] * 15)
    for mode in ("mse", "mae"):
        assert chosen_scale(x, four_over_six=mode, amax=G1) == "4"
        assert torch.equal(fake_quantize(x, "nvfp4", four_over_six=mode, amax=G1), x)


def test_max4_scale_saturating_e4m3_at_bound_448():
    """A block holding the tensor amax: at bound 448 its max/6 scale is 448 and its max/4 scale
    saturates at 448 too (672 > 448): the candidates are identical, max/6 is kept. At bound 256
    the max/4 scale fits (384) and wins on a block whose values sit on its grid."""
    x = block([2688.0] + [2016.0] * 15)  # 2016 = 4.5 * 448
    for mode in ("mse", "mae"):
        assert chosen_scale(x, four_over_six=mode) == "6"
        four = fake_quantize(x, "nvfp4", four_over_six=mode, global_bound=256)
        plain256 = fake_quantize(x, "nvfp4", global_bound=256)
        assert errors(four, x, mode) < errors(plain256, x, mode)


def test_near_ties_that_mse_and_mae_decide_differently():
    """Grids: max/6 (scale 1) 0, .5, 1, 1.5, 2, 3, 4, 6; max/4 (scale 1.5) 0, .75, 1.5, 2.25, 3,
    4.5, 6 (ties to even on the E2M1 code). [6, .5, 2.5]: max/6 errs 0 and .5 (2.5 -> 2), max/4
    .25 (.5 -> .75) and .25 (2.5 -> 2.25): MAE .5 vs .5, a tie (max/6); MSE .25 vs .125 (max/4).
    [6, .75, 3.75, 4.5]: max/6 errs .25 (.75 -> 1), .25 (3.75 -> 4), .5 (4.5 -> 4); max/4 0,
    .75 (3.75 -> 3), 0: MAE 1 vs .75 (max/4); MSE .375 vs .5625 (max/6)."""
    x = block([6.0, 0.5, 2.5] + [0.0] * 13)
    assert chosen_scale(x, four_over_six="mae", amax=G1) == "6"
    assert chosen_scale(x, four_over_six="mse", amax=G1) == "4"
    x = block([6.0, 0.75, 3.75, 4.5] + [0.0] * 12)
    assert chosen_scale(x, four_over_six="mae", amax=G1) == "4"
    assert chosen_scale(x, four_over_six="mse", amax=G1) == "6"
    assert torch.equal(errors(fake_quantize(x, "nvfp4", amax=G1), x, "mae"), torch.tensor([1.0]))
    assert torch.equal(errors(fake_quantize(x, "nvfp4", four_over_six="mae", amax=G1), x, "mae"),
                       torch.tensor([0.75]))
