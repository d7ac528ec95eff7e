"""ErrorStats / BlockExponentHistogram: streaming sums equal a direct float64 computation."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from qtransform.core import metrics
from qtransform.core.metrics import BlockExponentHistogram, ErrorStats
from qtransform.formats import fastpath

RTOL = 1e-12


def direct(x: torch.Tensor, q: torch.Tensor, sat: torch.Tensor | None = None) -> dict[str, float]:
    """The reference: every metric from whole tensors in float64, written independently."""
    x, q = x.double().reshape(-1), q.double().reshape(-1)
    e = x - q
    nz = x != 0
    mean = x.mean()
    var = ((x - mean) ** 2).mean()
    qc = q - q.mean()
    return {
        "sqnr_db": 10 * math.log10(float((x**2).sum() / (e**2).sum())),
        "mse": float((e**2).mean()),
        "rmse": float((e**2).mean().sqrt()),
        "rel_rmse": float((e**2).mean().sqrt() / var.sqrt()),
        "cosine": float((x * q).sum() / (x.norm() * q.norm())),
        "max_abs_error": float(e.abs().max()),
        "deadzone": int((nz & (q == 0)).sum()) / int(nz.sum()),
        "mean_rel_error": float((e.abs()[nz] / x.abs()[nz]).mean()),
        "kurtosis_orig": float(((x - mean) ** 4).mean() / var**2),
        "kurtosis_quant": float((qc**4).mean() / (qc**2).mean() ** 2),
        "saturation": float(sat.double().mean()) if sat is not None else math.nan,
    }


def quantize_like(x: torch.Tensor, step: float = 0.25) -> torch.Tensor:
    """A crude quantizer with a deadzone, a saturation band and exact zeros."""
    return (torch.round(x / step) * step).clamp(-2.0, 2.0)


def assert_close(got: dict[str, float], want: dict[str, float], rtol: float = RTOL) -> None:
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            assert got[key] == pytest.approx(value, rel=rtol, abs=0.0), key


def test_chunked_updates_equal_direct_float64_over_the_whole_tensor():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g) * 0.7 + 0.05 for n in (5, 4096, 200_001, 1)]
    stats = ErrorStats()
    for c in chunks:
        stats.update(c, quantize_like(c), quantize_like(c).abs() == 2.0)
    x = torch.cat(chunks)
    assert_close(stats.result(), direct(x, quantize_like(x), quantize_like(x).abs() == 2.0))
    assert stats.result()["n"] == x.numel()


def test_bf16_inputs_and_any_shape():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 96, generator=g) * 0.02).bfloat16()
    q = (quantize_like(x.float() * 50) / 50).bfloat16()
    stats = ErrorStats().update(x[:10], q[:10]).update(x[10:], q[10:])
    assert_close(stats.result(), {k: v for k, v in direct(x, q).items() if k != "saturation"})


def test_identical_tensors_give_infinite_sqnr_and_zero_error():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    r = ErrorStats().update(x, x.clone()).result()
    assert r["sqnr_db"] == math.inf
    assert r["mse"] == r["max_abs_error"] == r["deadzone"] == r["mean_rel_error"] == 0.0
    assert r["cosine"] == pytest.approx(1.0, rel=1e-15)
    assert math.isnan(r["saturation"])  # no mask given: unknown, not 0


def test_all_zero_gives_nan_not_an_epsilon_value():
    z = torch.zeros(64)
    r = ErrorStats().update(z, z).result()
    for key in ("sqnr_db", "cosine", "deadzone", "mean_rel_error", "rel_rmse", "kurtosis_orig"):
        assert math.isnan(r[key]), key
    assert r["mse"] == 0.0
    only_error = ErrorStats().update(z, torch.full((64,), 0.5)).result()
    assert only_error["sqnr_db"] == -math.inf


def test_sqnr_is_scale_invariant():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    a = ErrorStats().update(x, quantize_like(x)).result()["sqnr_db"]
    b = ErrorStats().update(x * 1e-6, quantize_like(x) * 1e-6).result()["sqnr_db"]
    assert a == pytest.approx(b, rel=1e-6)


def test_merge_equals_one_accumulator_and_state_round_trips():
    g = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(3000, generator=g), torch.randn(777, generator=g) * 3
    a = ErrorStats().update(x1, quantize_like(x1), x1.abs() > 2)
    b = ErrorStats().update(x2, quantize_like(x2), x2.abs() > 2)
    x = torch.cat([x1, x2])
    whole = ErrorStats().update(x, quantize_like(x), x.abs() > 2).result()
    assert_close(a.merge(b).result(), {k: v for k, v in whole.items() if isinstance(v, float)})
    again = ErrorStats.from_state(a.state())
    assert again.result() == a.result()
    assert ErrorStats().merge(ErrorStats()).result()["n"] == 0


def test_nan_and_inf_pairs_are_counted_and_left_out():
    x = torch.tensor([1.0, -2.0, float("nan"), 0.3, float("inf"), 0.01])
    q = torch.tensor([1.0, -2.0, 0.0, 0.25, float("nan"), 0.0])
    s = ErrorStats().update(x, q).result()
    keep = torch.tensor([0, 1, 3, 5])
    assert (s["nan_orig"], s["nan_quant"], s["nonfinite"], s["n"]) == (1, 1, 2, 4)
    assert_close(s, {k: v for k, v in direct(x[keep], q[keep]).items() if k != "saturation"})


def test_zero_input_with_nonzero_output_is_not_in_relative_error_or_deadzone():
    # noise can turn an exact zero into a value; relative error is undefined there
    x = torch.tensor([0.0, 0.0, 1.0, 0.02, -0.5])
    q = torch.tensor([0.1, 0.0, 1.0, 0.0, -0.25])
    r = ErrorStats().update(x, q).result()
    assert r["nonzero"] == 3 and r["deadzone_count"] == 1
    assert r["mean_rel_error"] == pytest.approx((0 + 1 + 0.5) / 3, rel=RTOL)


def test_kurtosis_is_pearson_non_excess():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))
    assert ErrorStats().update(x, x).result()["kurtosis_orig"] == pytest.approx(3.0, abs=0.05)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape mismatch"):
        ErrorStats().update(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("fast", ["1", "0"])  # the compiled kernel, then the torch path
@settings(max_examples=40, deadline=None)
@given(
    arrays(np.float32, st.integers(1, 400),
           elements=st.one_of(st.just(0.0), st.floats(-1e3, 1e3, width=32))),
    st.lists(st.integers(0, 400), max_size=6),
    st.integers(16, 128),
)
def test_chunking_does_not_change_the_result(fast, values, cuts, chunk):
    default_chunk, metrics._CHUNK = metrics._CHUNK, chunk  # also exercise the torch path's chunks
    before = os.environ.get("QTRANSFORM_FASTPATH")
    os.environ["QTRANSFORM_FASTPATH"] = fast
    try:
        x = torch.from_numpy(values)
        q = quantize_like(x, step=0.5)
        sat = x.abs() > 2
        bounds = sorted({0, len(x), *(c % (len(x) + 1) for c in cuts)})
        chunked = ErrorStats()
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            chunked.update(x[lo:hi], q[lo:hi], sat[lo:hi])
        one = ErrorStats().update(x, q, sat)
    finally:
        metrics._CHUNK = default_chunk
        if before is None:
            os.environ.pop("QTRANSFORM_FASTPATH")
        else:
            os.environ["QTRANSFORM_FASTPATH"] = before
    a, b = chunked.result(), one.result()
    # sums of non-negative terms: relative agreement
    for key in ("sqnr_db", "mse", "cosine", "max_abs_error", "deadzone", "saturation", "mean_rel_error"):
        assert (math.isnan(a[key]) and math.isnan(b[key])) or a[key] == pytest.approx(b[key], rel=RTOL), key
    # signed power sums can cancel: agreement relative to the sum of magnitudes
    sa, sb = chunked.state(), one.state()
    x64 = x.double()
    for key, power in (("sum_x", 1), ("sum_x3", 3)):
        scale = float((x64.abs() ** power).sum())
        assert abs(sa[key] - sb[key]) <= RTOL * scale, key


def test_block_exponent_histogram_counts_and_merges():
    h = BlockExponentHistogram().update(torch.tensor([[-3, -3, 0], [128, -127, 2]], dtype=torch.int32))
    r = h.result()
    assert r["counts"] == {"-127": 1, "-3": 2, "0": 1, "2": 1}
    assert (r["blocks"], r["min"], r["max"], r["out_of_range"]) == (6, -127, 2, 1)
    merged = BlockExponentHistogram.from_result(r).merge(BlockExponentHistogram().update(torch.tensor([5])))
    assert merged.result()["max"] == 5 and merged.result()["blocks"] == 7
    assert BlockExponentHistogram().result()["min"] is None


# -- the compiled statistics kernel (fastpath.error_stats) against the torch path ---------------
NAN, INF = float("nan"), float("inf")
SIGNED = {"sum_x": 1, "sum_x3": 3, "sum_q": 1, "sum_q3": 3, "sum_xq": 2}  # sums that can cancel


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random data over scales, sizes beyond one kernel chunk, and adversarial pairs."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n, scale in ((1, 1.0), (3, 1e-3), (255, 1.0), (4099, 30.0), (70_001, 0.02)):
        x = torch.randn(n, generator=g) * scale
        out.append((x, quantize_like(x / scale) * scale))
    specials = [0.0, -0.0, 1e-45, -1e-40, 2.0**-126, 6e-8, 3e-5, 3.4e38, -3.4e38, 65504.0,
                70000.0, NAN, INF, -INF, 1.0, -2.5, 0.3]
    s = torch.tensor(specials)
    x, q = s.repeat_interleave(len(s)), s.repeat(len(s))  # every pair of specials
    out.append((x, q))
    x = torch.randn(50_000, generator=g) * 4
    x[::7], x[3::11], x[5::13], x[6::17] = 0.0, -0.0, NAN, INF
    q = quantize_like(x)
    q[1::19], q[2::23], q[7::29] = NAN, 0.0, 0.7  # NaN only in xq; deadzone; x == 0 with xq != 0
    out.append((x, q))
    out.append((torch.full((40,), NAN), torch.zeros(40)))  # nothing finite
    return out


def _both_paths(x, q, sat, monkeypatch) -> tuple[dict, dict]:
    with monkeypatch.context() as m:  # explicit: the mutation runs set QTRANSFORM_FASTPATH=0
        m.setenv("QTRANSFORM_FASTPATH", "1")
        fast = ErrorStats().update(x, q, sat).state()
    with monkeypatch.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        ref = ErrorStats().update(x, q, sat).state()
    return fast, ref


def _assert_same_state(fast: dict, ref: dict, x: torch.Tensor, q: torch.Tensor) -> None:
    ok = torch.isfinite(x) & torch.isfinite(q)
    mags = {"x": x.double()[ok].abs(), "q": q.double()[ok].abs()}
    for key, want in ref.items():
        got = fast[key]
        if key in SIGNED:  # agreement relative to the sum of magnitudes of the terms
            scale = float((mags["x"] * mags["q"]).sum()) if key == "sum_xq" else float(
                (mags[key[4]] ** SIGNED[key]).sum())
            assert abs(got - want) <= RTOL * scale, key
        elif key.startswith("sum_"):
            assert got == pytest.approx(want, rel=RTOL, abs=0.0), key
        else:  # counts and max |e|: exact
            assert got == want, key


@pytest.mark.skipif(fastpath.library() is None, reason="no C compiler: only the torch path runs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_kernel_equals_the_torch_path(dtype, threads, monkeypatch):
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "1")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x, q in _pairs():
            x, q = x.to(dtype), q.to(dtype)
            assert fastpath.error_stats(x, q, None, torch.zeros(fastpath.STATS_SLOTS, dtype=torch.float64))
            for sat in (None, x.float().abs() > 2):
                fast, ref = _both_paths(x, q, sat, monkeypatch)
                _assert_same_state(fast, ref, x, q)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.skipif(fastpath.library() is None, reason="no C compiler: only the torch path runs")
def test_fused_kernel_result_does_not_depend_on_threads_or_layout(monkeypatch):
    x = torch.randn(300, 257, generator=torch.Generator().manual_seed(8))
    q = quantize_like(x)
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "1")
    prev = torch.get_num_threads()
    states = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            states.append(ErrorStats().update(x, q).state())
    finally:
        torch.set_num_threads(prev)
    assert states[0] == states[1]  # fixed chunks, added in order: bit-identical sums
    assert ErrorStats().update(x.T, q.T).state() == ErrorStats().update(x.T.contiguous(), q.T.contiguous()).state()


def test_unsupported_inputs_take_the_torch_path_with_the_same_result(monkeypatch):
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1000, generator=g)
    q, sat = quantize_like(x), x.abs() > 2
    acc = torch.zeros(fastpath.STATS_SLOTS, dtype=torch.float64)
    assert not fastpath.error_stats(x.double(), q.double(), None, acc)  # float64
    assert not fastpath.error_stats(x, q.bfloat16(), None, acc)  # mixed dtypes
    assert not fastpath.error_stats(x, q, sat.float(), acc)  # a non-bool mask
    assert not acc.any()
    want = ErrorStats().update(x, q, sat).state()
    for args in ((x.double(), q.double(), sat), (x, q, sat.float())):
        _assert_same_state(ErrorStats().update(*args).state(), want, x, q)
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    assert not fastpath.error_stats(x, q, None, acc)


def test_block_exponent_histogram_paths_agree(monkeypatch):
    e = torch.tensor([-200, -128, -127, -3, 0, 127, 128, 1000, 5, 5], dtype=torch.int32)
    with monkeypatch.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "1")
        fast = BlockExponentHistogram().update(e).result()
    with monkeypatch.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        ref = BlockExponentHistogram().update(e).result()
    assert fast == ref == BlockExponentHistogram().update(e.to(torch.int64)).result()
    assert (ref["out_of_range"], ref["counts"]["5"], ref["min"], ref["max"]) == (4, 2, -127, 127)


def test_count_properties_read_the_accumulator():
    empty = ErrorStats()
    assert (empty.n, empty.saturation_checked, empty.nan_orig, empty.nan_quant, empty.nonfinite) == (0, 0, 0, 0, 0)
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf"), 0.5])
    q = torch.tensor([1.0, 2.0, float("nan"), 4.0, 0.5])
    s = ErrorStats().update(x, q, torch.tensor([True, False, True, False, False]))
    # pairs 0 and 4 are finite; x has one NaN, q one NaN; the Inf pair is non-finite too
    assert (s.n, s.saturation_checked, s.nan_orig, s.nan_quant, s.nonfinite) == (2, 2, 1, 1, 3)
    r = s.result()  # the mask counts only on measured pairs: pair 2 (NaN in q) is left out
    assert (r["saturated_count"], r["saturation"], r["nonzero"], r["deadzone_count"]) == (1, 0.5, 2, 0)


def test_block_exponent_histogram_accumulates_merges_and_keeps_exact_counts():
    # int8 exponents (an E8M0 field read as signed) must not wrap when shifted into bins
    a = BlockExponentHistogram().update(torch.tensor([-127, 0, 127, 127, -128], dtype=torch.int8))
    a.update(torch.tensor([0, 5, 300], dtype=torch.int32))
    assert a.result() == {"blocks": 8, "min": -127, "max": 127, "out_of_range": 2,
                          "counts": {"-127": 1, "0": 2, "5": 1, "127": 2}}
    b = BlockExponentHistogram().update(torch.tensor([5, -1000]))
    merged = a.merge(b).result()
    assert (merged["counts"]["5"], merged["out_of_range"], merged["blocks"]) == (2, 3, 10)
    big = BlockExponentHistogram.from_result({"counts": {"3": 2**40 + 1}, "out_of_range": 0})
    assert big.result()["counts"] == {"3": 2**40 + 1} and big.result()["blocks"] == 2**40 + 1
