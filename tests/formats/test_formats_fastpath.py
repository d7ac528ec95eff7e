"""The compiled CPU fast path is bit-identical to the torch reference path, and optional."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

from qtransform.core.metrics import ErrorStats
from qtransform.formats import block_exponents, fake_quantize, fastpath, get, names, saturated
from qtransform.formats.options import resolve
from qtransform.formats.quantize import layout_for, quantize_with_info
from tests.formats.conftest import HAS_CC

NAN, INF = float("nan"), float("inf")

CONFIGS = (
    [(f, {"scale_rule": r, "rounding": o}) for f in names() if f.startswith("mx")
     for r in ("floor", "rceil", "ceil", "even", "compressed-tensors") for o in ("rne", "rna")]
    + [("nvfp4", {"nvfp4_variant": v, "rounding": o})
       for v in ("default", "compressed-tensors", "one_level") for o in ("rne", "rna")]
    + [(f, {"rounding": o}) for f in ("int4", "int8", "fp8_e4m3", "fp8_e5m2") for o in ("rne", "rna")]
    # stochastic rounding: the same Philox stream on both paths
    + [(f, {"rounding": "stochastic", "seed": 5})
       for f in ("mxfp4", "mxfp6_e3m2", "mxint8", "int4", "fp8_e4m3")]
    + [("nvfp4", {"nvfp4_variant": v, "rounding": "stochastic", "seed": 2**64 - 7})
       for v in ("default", "compressed-tensors", "one_level")]
)
CONFIG_IDS = [f"{f}-{'-'.join(str(v) for v in o.values())}" for f, o in CONFIGS]


def _datasets() -> list[torch.Tensor]:
    """Random data over many scales and distributions, then adversarial blocks."""
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(9, 70, generator=g) * s for s in (1e-30, 1e-6, 1.0, 3e4, 1e30)]
    out.append(torch.rand(9, 70, generator=g) ** 6 * 10)  # skewed, positive
    out.append(torch.randn(9, 70, generator=g) / torch.rand(9, 70, generator=g))  # heavy tails
    out.append(torch.rand(9, 70, generator=g) ** 4 * 2.0**-120)  # subnormal territory
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.25, 7.5, 0.125, 0.375,
                         7.9999995, 3.9999998, 1.9999999, 448.0, 464.0, 480.0, 57344.0,
                         2.0**-127, 2.0**-126, 2.0**-149, 1e-45, 3.4e38, -0.0, 0.0, 1.0])
    adv = torch.cat([ties * s for s in (1.0, -1.0, 2.0**-60, 2.0**60, 1 / 3)]).reshape(5, 26)
    out.append(torch.cat([adv, adv.flip(1), adv * 7], 1))
    zero = torch.zeros(4, 64)
    zero[1, ::2] = -0.0
    zero[2, 40] = 1e-40
    out.append(zero)
    for special in (NAN, INF, -INF):  # NVFP4 default: a NaN anywhere makes the tensor NaN
        s = torch.randn(4, 64, generator=g)
        s[1, 3] = special
        out.append(s)
    # rows of whole blocks (up to 128, int groups' default) take the kernel's vector path; the
    # ragged sets above its scalar path: the same cases again, 256 columns wide
    rows = [torch.randn(256, generator=g) * s for s in (1e-30, 1e-6, 1.0, 3e4, 1e30)]
    rows += [torch.rand(256, generator=g) ** 6 * 10, torch.randn(256, generator=g) / torch.rand(256, generator=g),
             torch.rand(256, generator=g) ** 4 * 2.0**-120]
    # subnormal blocks, and amax / max_normal just below 2^-126 (rceil's subnormal branch)
    rows += [torch.rand(256, generator=g) * 2.0**k for k in (-140, -128, -124, -118)]
    out.append(torch.stack(rows))
    ties_row = torch.cat([adv.flatten(), (adv * 7).flatten().flip(0)])[:256]
    out.append(torch.stack([ties_row, ties_row * -1 / 3, ties_row * 2.0**-70, ties_row.roll(5)]))
    out.append(torch.cat([zero, zero.flip(1)], 1))
    for special in (NAN, INF, -INF):
        s = torch.randn(4, 256, generator=g)
        s[2, 200] = special
        out.append(s)
    return out


DATA = _datasets()


def _reference(x: torch.Tensor, fmt: str, mp: pytest.MonkeyPatch, **opts) -> torch.Tensor:
    with mp.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        return fake_quantize(x, fmt, **opts)


def _ref_sat(x: torch.Tensor, fmt: str, mp: pytest.MonkeyPatch, **opts) -> torch.Tensor:
    with mp.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        return saturated(x, fmt, **opts)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_fast_path_builds_in_ci():
    """CI must exercise the fast path: its absence there fails instead of skipping quietly."""
    if not os.environ.get("CI"):
        pytest.skip("only enforced where CI is set")
    assert fastpath.library() is not None, f"fast path unavailable in CI: {fastpath.unavailable_reason()}"


@pytest.mark.parametrize(("fmt", "opts"), CONFIGS, ids=CONFIG_IDS)
def test_bit_identical_to_reference(lib, fmt, opts, monkeypatch):
    # the formats' default tiles (clamped on short dims), and a ragged tile that fits every set
    tile = get(fmt).tile if fmt.startswith(("mx", "nv")) else (4, 32)
    layouts = [{}, {"axis": 0}, {"block_shape": tile}]
    if fmt.startswith(("int", "fp8")):
        layouts += [{"block_size": 32}, {"granularity": "token"}, {"granularity": "channel", "axis": 0}]
    for x, lay in itertools.product(DATA, layouts):
        cfg = resolve(fmt, **{k: v for k, v in opts.items() if k != "seed"}, **lay)
        assert fastpath.quantize(x, cfg, layout_for(x, cfg), False, seed=1) is not None
        fast, ref = fake_quantize(x, fmt, **opts, **lay), _reference(x, fmt, monkeypatch, **opts, **lay)
        assert _same(fast, ref), (
            f"{lay} max|x|={x.abs().max().item()}: {(fast.view(torch.int32) != ref.view(torch.int32)).sum()} differ"
        )
        assert torch.equal(saturated(x, fmt, **opts, **lay),
                           _ref_sat(x, fmt, monkeypatch, **opts, **lay))


@pytest.mark.parametrize(("fmt", "opts"), [("mxfp4", {}), ("mxfp8_e4m3", {"scale_rule": "even"}),
                                           ("nvfp4", {}), ("int8", {"rounding": "rna"})])
def test_multithreaded_and_other_dtypes(lib, fmt, opts, monkeypatch):
    prev = torch.get_num_threads()
    for cols in (130, 256):  # ragged rows (scalar path), whole blocks (vector path)
        x = torch.randn(3, 250, cols) * torch.logspace(-8, 8, cols)  # > MIN_PARALLEL elements
        torch.set_num_threads(2)
        try:
            for lay in ({}, {"axis": 1}):
                assert _same(fake_quantize(x, fmt, **opts, **lay),
                             _reference(x, fmt, monkeypatch, **opts, **lay))
        finally:
            torch.set_num_threads(prev)
        for dtype in (torch.bfloat16, torch.float16):
            xd = x[0].to(dtype)
            a, b = fake_quantize(xd, fmt, **opts), _reference(xd, fmt, monkeypatch, **opts)
            assert a.dtype == dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_kernel_runs_on_torchs_openmp_runtime_not_a_second_one(lib):
    """Two OpenMP runtimes in one process are two thread pools on the same cores: the kernel's
    libgomp must be the one torch loaded, so its threads are torch's intra-op pool."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fake_quantize(torch.randn(512, 1024), "mxfp4")  # a parallel region of the kernel
    finally:
        torch.set_num_threads(prev)
    runtimes = fastpath.openmp_runtimes()
    assert len(runtimes) <= 1, runtimes
    built_with_openmp = b"libgomp.so.1" in Path(lib._name).read_bytes()
    assert built_with_openmp == fastpath.torch_openmp()  # GNU OpenMP in torch: the kernel uses it


def test_no_openmp_in_the_kernel_where_torch_runs_another_runtime(monkeypatch, tmp_path):
    if not HAS_CC:
        pytest.skip("no C compiler")
    monkeypatch.setattr(fastpath, "torch_openmp", lambda: False)  # e.g. a build on Intel's libiomp5
    monkeypatch.setattr(fastpath, "_lib", None)
    monkeypatch.setattr(fastpath, "_failed", False)
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path))
    lib = fastpath.library()
    assert lib is not None and b"libgomp.so.1" not in Path(lib._name).read_bytes()
    x = torch.randn(300, 256)
    assert _same(fake_quantize(x, "nvfp4"), _reference(x, "nvfp4", monkeypatch))


def test_long_single_row_is_split_across_tasks(lib, monkeypatch):
    x = torch.randn(1, 200_000)
    assert _same(fake_quantize(x, "mxfp4"), _reference(x, "mxfp4", monkeypatch))


def test_zero_saturated_grad_uses_the_same_mask(lib, monkeypatch):
    x = torch.randn(5, 96) * 5
    xg = x.clone().requires_grad_()
    fake_quantize(xg, "mxfp4", zero_saturated_grad=True).sum().backward()
    assert torch.equal(xg.grad, (~_ref_sat(x, "mxfp4", monkeypatch)).float())


def test_env_var_disables(lib, monkeypatch):
    x = torch.randn(4, 64)
    cfg = resolve("mxfp4")
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    assert fastpath.quantize(x, cfg, layout_for(x, cfg), False) is None
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "1")
    assert fastpath.quantize(x, cfg, layout_for(x, cfg), False) is not None


def test_not_used_for_stochastic_without_seed_or_empty(lib):
    x = torch.randn(4, 64)
    cfg = resolve("mxfp4", rounding="stochastic")
    assert fastpath.quantize(x, cfg, layout_for(x, cfg), False) is None
    assert fastpath.quantize(x, cfg, layout_for(x, cfg), False, seed=0) is not None
    e = torch.empty(0, 32)
    cfg = resolve("mxfp4")
    assert fastpath.quantize(e, cfg, layout_for(e, cfg), False) is None


def test_no_compiler_falls_back_silently(monkeypatch, tmp_path):
    monkeypatch.setattr(fastpath, "_lib", None)
    monkeypatch.setattr(fastpath, "_failed", False)
    monkeypatch.setenv("CC", "no-such-compiler-qtransform")
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 64)
    out = fake_quantize(x, "nvfp4")
    assert fastpath.library() is None and fastpath._failed
    assert _same(out, _reference(x, "nvfp4", monkeypatch))


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    if not HAS_CC:
        pytest.skip("no C compiler")
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path))
    first = fastpath.build()
    assert first is not None and first.is_relative_to(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert fastpath.build() == first and first.stat().st_mtime_ns == stamp
    # no temp files left: the library and its manifest
    assert sorted(p.name for p in first.parent.iterdir()) == ["libqfast.so", "libqfast.so.sha256"]


def test_broken_source_falls_back(monkeypatch, tmp_path):
    bad = tmp_path / "qfast.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(fastpath, "SOURCE", bad)
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path / "cache"))
    assert fastpath.build() is None
    assert not any((tmp_path / "cache").rglob("*.so"))


@pytest.mark.parametrize("flags", [[], ["-march=native", "-mno-avx512f", "-fopenmp"],
                                   ["-march=native", "-mno-avx512dq", "-mno-avx512bw", "-fopenmp"]],
                         ids=["portable", "native-without-avx512", "native-without-avx512dq-bw"])
def test_other_builds_are_bit_identical_too(flags, monkeypatch, tmp_path):
    """The fallback flag set (no -march=native, no OpenMP) computes the same bits, and so does
    a native build without AVX-512 (the scalar path everywhere, with F16C where the CPU has it),
    which is what a CPU without AVX-512 compiles, and one whose vector path saturates without
    vrangeps (AVX512DQ), narrows to bf16 without vcvtneps2bf16 (AVX512_BF16, which needs
    AVX512BW) and reduces 16-bit blocks in 32-bit lanes (AVX512BW)."""
    if not HAS_CC:
        pytest.skip("no C compiler")
    monkeypatch.setattr(fastpath, "FLAG_SETS", (flags,))
    monkeypatch.setattr(fastpath, "_lib", None)
    monkeypatch.setattr(fastpath, "_failed", False)
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path))
    if fastpath.library() is None:
        assert flags, f"the portable build must compile: {fastpath.unavailable_reason()}"
        pytest.skip(f"this compiler or CPU does not take {flags}")
    for (fmt, opts), x in itertools.product(CONFIGS[::5], DATA[::2]):
        assert _same(fake_quantize(x, fmt, **opts), _reference(x, fmt, monkeypatch, **opts))
    for (fmt, opts), x, dtype in itertools.product(CONFIGS[::7], DATA[1::2], (torch.bfloat16, torch.float16)):
        xd = x.to(dtype)
        a, b = fake_quantize(xd, fmt, **opts), _reference(xd, fmt, monkeypatch, **opts)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (fmt, dtype)
    x = torch.cat([d.reshape(-1) for d in DATA])  # and the statistics kernel, with NaN and Inf
    xq, sat, _ = quantize_with_info(x, "mxfp4")
    fast = ErrorStats().update(x, xq, sat).state()
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    ref = ErrorStats().update(x, xq, sat).state()
    assert {k: v for k, v in fast.items() if not k.startswith("sum_")} == {
        k: v for k, v in ref.items() if not k.startswith("sum_")}
    for key in ("sum_x2", "sum_q4", "sum_e2", "sum_abs_e", "sum_rel"):
        assert fast[key] == pytest.approx(ref[key], rel=1e-12), key


@pytest.mark.parametrize(("fmt", "opts"), CONFIGS[::3], ids=CONFIG_IDS[::3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_fp16_inputs_are_read_natively_and_bit_identical(lib, fmt, opts, dtype, monkeypatch):
    for x, lay in itertools.product(DATA, ({}, {"axis": 0}, {"block_shape": (4, 16)})):
        xd = x.to(dtype)
        a, b = fake_quantize(xd, fmt, **opts, **lay), _reference(xd, fmt, monkeypatch, **opts, **lay)
        assert a.dtype == dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), lay
        assert torch.equal(saturated(xd, fmt, **opts, **lay), _ref_sat(xd, fmt, monkeypatch, **opts, **lay))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_with_info_is_one_call_of_the_three(lib, dtype, monkeypatch):
    """(fake_quantize, saturated, block_exponents) from one quantization, on both paths."""
    for (fmt, opts), x in itertools.product(CONFIGS[::2], DATA):
        mx = fmt.startswith("mx")
        for lay in ({}, {"axis": 0}, {"block_shape": (4, 16)}):
            xd = x.to(dtype)
            got = quantize_with_info(xd, fmt, exponents=mx, **opts, **lay)
            with monkeypatch.context() as m:
                m.setenv("QTRANSFORM_FASTPATH", "0")
                ref = quantize_with_info(xd, fmt, exponents=mx, **opts, **lay)
                want = (fake_quantize(xd, fmt, **opts, **lay), saturated(xd, fmt, **opts, **lay),
                        block_exponents(xd, fmt, **opts, **lay) if mx else None)
            bits = torch.int32 if dtype == torch.float32 else torch.int16
            for a, b, c in ((got[0].view(bits), ref[0].view(bits), want[0].view(bits)),
                            got[1:2] + ref[1:2] + want[1:2]):
                assert torch.equal(a, b) and torch.equal(b, c), (fmt, lay)
            if mx:
                assert torch.equal(got[2], ref[2]) and torch.equal(ref[2], want[2]), (fmt, lay)
                assert torch.equal(block_exponents(xd, fmt, **opts, **lay), want[2])  # fast path
            else:
                assert got[2] is None and ref[2] is None


def test_quantize_with_info_stochastic_and_errors(lib):
    x = torch.randn(4, 64)
    out, sat, exps = quantize_with_info(x, "mxfp4", rounding="stochastic",
                                        generator=torch.Generator().manual_seed(0))
    again = fake_quantize(x, "mxfp4", rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again) and torch.equal(sat, saturated(x, "mxfp4")) and exps is None
    with pytest.raises(ValueError, match="MX formats only"):
        quantize_with_info(x, "nvfp4", exponents=True)
    assert quantize_with_info(torch.tensor(3.3), "mxfp4", exponents=True)[2].shape == ()


def _narrowing_ties(dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """NVFP4 inputs in `dtype` whose fp32 result at index 17 lies exactly halfway between two
    `dtype` values, with an odd lower neighbour (ties to even rounds up there, truncation or
    ties-down would not). Found by search: the output q * (s * d) over one binade of tensor
    amaxes (d = 1 / (2688 / amax)), every positive E4M3 block scale s and every E2M1 value q;
    each candidate is built as a tensor (amax first; a block [s / g6, q * s * d]) and kept when
    the reference confirms the tie."""
    bit = 16 if dtype == torch.bfloat16 else 13
    # amaxes in [1024, 2048): scaling by a power of two keeps every tie, and puts the results
    # among fp16's normal numbers (its subnormals round at another bit)
    first = torch.tensor(1024.0, dtype=dtype).view(torch.int16).item()
    amax = torch.arange(first, first + (1 << (23 - bit)), dtype=torch.int16).view(dtype).float()
    e4m3 = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    sd = e4m3[None, :] * (1.0 / (2688.0 / amax))[:, None]  # [amax, s]
    out = grid * sd[..., None]  # [amax, s, q]
    bits = out.view(torch.int32)
    ties = ((bits & ((1 << bit) - 1)) == 1 << (bit - 1)) & ((bits >> bit) & 1 == 1)
    cases = []
    for ia, js, kq in ties.nonzero().tolist():
        g = torch.tensor(2688.0) / amax[ia]
        row = torch.zeros(32)
        row[0], row[16], row[17] = amax[ia], e4m3[js] / (g * torch.tensor(1 / 6)), out[ia, js, kq]
        cases.append(row.to(dtype))
        if len(cases) == 4 * count:
            break
    return cases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrowing_rounds_exact_ties_to_even(lib, dtype, monkeypatch):
    """The kernel's own narrowing (fp32 -> bf16/fp16) is torch's `.to()`: ties to even, on
    whole-block rows (vector path) and ragged ones (scalar path)."""
    bit = 16 if dtype == torch.bfloat16 else 13
    checked = 0
    for row in _narrowing_ties(dtype, 3):
        ref32 = _reference(row.float(), "nvfp4", monkeypatch)
        b = ref32.view(torch.int32)[17].item()
        if (b & ((1 << bit) - 1)) != 1 << (bit - 1) or not (b >> bit) & 1:
            continue  # the candidate's block scale came out differently: not a tie after all
        checked += 1
        expected = ref32.to(dtype)
        assert expected[17].view(torch.int16).item() & 1 == 0  # rounded up to the even neighbour
        for width in (32, 34):
            x = torch.cat([row, torch.zeros(width - 32, dtype=dtype)])
            fast = fake_quantize(x, "nvfp4")[:32]
            assert torch.equal(fast.view(torch.int16), expected.view(torch.int16)), width
            assert torch.equal(_reference(x, "nvfp4", monkeypatch)[:32].view(torch.int16),
                               expected.view(torch.int16))
    assert checked >= 3


@pytest.mark.parametrize(("fmt", "opts"), [(f, o) for f, o in CONFIGS if o.get("rounding") == "stochastic"],
                         ids=[i for (f, o), i in zip(CONFIGS, CONFIG_IDS, strict=True) if o.get("rounding") == "stochastic"])
def test_vector_path_on_a_moved_axis_draws_each_element_its_own_uniform(lib, fmt, opts, monkeypatch):
    """Blocks along a middle axis of 1024 (whole blocks: the vector path, in groups of 16
    blocks) sit `post` = 7 elements apart in the tensor; stochastic rounding must still give each
    element the draw of its own position, as the reference does, in every dtype."""
    x = torch.randn(3, 1024, 7, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 7)
    block = {"block_size": 16} if fmt in ("int4", "int8") else {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        a = fake_quantize(xd, fmt, axis=1, **opts, **block)
        b = _reference(xd, fmt, monkeypatch, axis=1, **opts, **block)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits)), dtype


def test_vector_path_block_exponents_past_the_first_group(lib, monkeypatch):
    """Rows of 32 MX blocks (two groups of 16 on the vector path; 16 rows, so a row is one
    task): every block's E lands at its own index, for every scale rule, with the amax varying
    along the row."""
    x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(4)) * torch.logspace(-20, 20, 1024)
    for rule in ("floor", "rceil", "ceil", "even"):
        fast = quantize_with_info(x, "mxfp4", exponents=True, scale_rule=rule)
        with monkeypatch.context() as m:
            m.setenv("QTRANSFORM_FASTPATH", "0")
            ref = quantize_with_info(x, "mxfp4", exponents=True, scale_rule=rule)
        assert fast[2].shape == (16, 32) and torch.equal(fast[2], ref[2]), rule
        assert _same(fast[0], ref[0]) and torch.equal(fast[1], ref[1]), rule  # values, saturation
        assert torch.equal(block_exponents(x, "mxfp4", scale_rule=rule), ref[2])  # exponents only


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "int4"])
def test_outputs_past_the_streaming_size_are_bit_identical(lib, fmt, monkeypatch):
    """Outputs of 8 MiB and more are written around the cache (non-temporal stores, qfast.c
    STREAM_BYTES): the values, NaN blocks included, are those of the reference in every dtype.
    Rows of 2048 (four groups of blocks per task), 2048 rows in half precision: exactly 8 MiB."""
    x = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(5)) * torch.logspace(-4, 4, 2048)
    x[7, 100] = float("nan")  # one NaN block (NVFP4: a NaN tensor scale, all NaN)
    block = {"block_size": 16} if fmt == "int4" else {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert xd.numel() * xd.element_size() >= 8 << 20
        a, b = fake_quantize(xd, fmt, **block), _reference(xd, fmt, monkeypatch, **block)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(a.view(bits), b.view(bits)), dtype
        if fmt != "nvfp4":
            assert a[7, 96:112].isnan().all() and not a[8].isnan().any(), dtype


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_mx_blocks_at_the_edges_of_in_place_rounding_are_bit_identical(lib, fmt, monkeypatch):
    """The vector path rounds an MX block where it is (no multiplication by 2^-E and 2^E) only
    while 2^E, the scaled grid and its rounding constants are normal fp32 (qfast.c, POW2 plans).
    Rows of blocks whose exponents sweep across both edges of that range, with fp32 subnormals
    among the elements, get the reference's values, saturation flags and exponents."""
    g = torch.Generator().manual_seed(11)
    scales = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float64)
    x = torch.randn(len(scales), 512, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randn(x.shape, generator=g, dtype=torch.float64) * 4)
    x = (x * scales[:, None]).clamp(-3e38, 3e38).float()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        fast = quantize_with_info(xd, fmt, exponents=True)
        with monkeypatch.context() as m:
            m.setenv("QTRANSFORM_FASTPATH", "0")
            ref = quantize_with_info(xd, fmt, exponents=True)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(fast[0].view(bits), ref[0].view(bits)), dtype
        assert torch.equal(fast[1], ref[1]) and torch.equal(fast[2], ref[2]), dtype


@pytest.mark.parametrize("variant", ["default", "compressed-tensors"])
def test_a_given_tensor_amax_is_bit_identical_on_both_paths(lib, variant, monkeypatch):
    """`amax=` (static and fused NVFP4 global scales) runs in the kernel: the same bits as the
    reference, NaN/Inf blocks and a tensor amax below, at or above x's own included."""
    for x, amax in itertools.product(DATA, (None, 0.0, 3.0, float("nan"), float("inf"))):
        a_t = x.abs().amax() if amax is None else torch.tensor(amax)
        cfg = resolve("nvfp4", nvfp4_variant=variant)
        assert fastpath.quantize(x, cfg, layout_for(x, cfg), False, amax=a_t) is not None
        for xd in (x, x.to(torch.bfloat16)):
            got = fake_quantize(xd, "nvfp4", nvfp4_variant=variant, amax=a_t)
            want = _reference(xd, "nvfp4", monkeypatch, nvfp4_variant=variant, amax=a_t)
            assert _same(got, want), (variant, amax, xd.dtype)
        assert torch.equal(saturated(x, "nvfp4", nvfp4_variant=variant, amax=a_t),
                           _ref_sat(x, "nvfp4", monkeypatch, nvfp4_variant=variant, amax=a_t))


@pytest.mark.parametrize("variant", ["default", "compressed-tensors"])
def test_one_amax_per_row_is_bit_identical_on_both_paths(lib, variant, monkeypatch):
    """Per-token NVFP4 global scales (`amax` shaped like x with the blocked axis 1) run in the
    kernel, along either axis, NaN rows and rows of zeros included."""
    for x in DATA:
        for axis in (-1, 0):
            rows = x.abs().amax(dim=axis, keepdim=True)
            rows.view(-1)[:1] = float("nan")
            rows.view(-1)[1:2] = 0.0
            cfg = resolve("nvfp4", nvfp4_variant=variant, axis=axis)
            assert fastpath.quantize(x, cfg, layout_for(x, cfg), False, amax=rows) is not None
            for xd in (x, x.to(torch.bfloat16)):
                got = fake_quantize(xd, "nvfp4", nvfp4_variant=variant, axis=axis, amax=rows)
                want = _reference(xd, "nvfp4", monkeypatch, nvfp4_variant=variant, axis=axis, amax=rows)
                assert _same(got.contiguous(), want.contiguous()), (variant, axis, xd.dtype)
