"""FP8 with one scale per tensor (`fastpath.fp8_tensor`, what a KV cache runs at every attention
call) is bit-identical to the torch path of `formats/fp8.py` for every variant, rounding, scale
source and dtype, on any fp32 bit pattern and on the values next to every rounding boundary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize, fastpath, get, saturated
from qtransform.formats.fp8 import VLLM_CPU_SUBNORMAL_GRID
from qtransform.formats.options import resolve

pytestmark = pytest.mark.skipif(fastpath.unavailable_reason() is not None,
                                reason=f"no CPU kernel: {fastpath.unavailable_reason()}")

QNAN = {torch.float32: (0x7FC00000, torch.int32), torch.bfloat16: (0x7FC0, torch.int16),
        torch.float16: (0x7E00, torch.int16)}
# the scales the KV presets use: 1.0 (vLLM without checkpoint scales) and calibrated amax / max
SCALES = [1.0, *(float(np.float32(a) / np.float32(448.0)) for a in (0.37, 3.1, 17.0, 251.3, 4096.0))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(QNAN[t.dtype][1])


def boundaries(fmt: str, scale: float) -> torch.Tensor:
    """Every grid point of the format, the midpoints between neighbours (ties), the first value
    past the max normal, vllm-cpu's 2^-29 pre-rounding grid below 2^-6 and its threshold, fp32
    subnormals, +-0, +-Inf and NaNs; each with its fp32 neighbours, both signs, times `scale`."""
    elem = get(fmt).element
    grid = elem.grid().to(torch.float64)
    step_top = grid[-1] - grid[-2]
    mids = (grid[1:] + grid[:-1]) / 2
    k = torch.tensor([0, 1, 2, 3, 5, 2**10 + 1, 2**23 - 2, 2**23 - 1], dtype=torch.float64)
    fine = torch.cat([k * VLLM_CPU_SUBNORMAL_GRID, (k + 0.5) * VLLM_CPU_SUBNORMAL_GRID,
                      torch.tensor([2.0**-6, 2.0**-149, 2.0**-127, 2.0**-126])])
    base = torch.cat([grid, mids, grid[-1:] + step_top / 2, grid[-1:] + step_top, fine]).to(torch.float32)
    base = (base * torch.tensor(scale, dtype=torch.float32)).repeat(3)
    n = base.numel() // 3
    base[:n] = torch.nextafter(base[:n], torch.tensor(float("inf")))
    base[n:2 * n] = torch.nextafter(base[n:2 * n], torch.tensor(0.0))
    special = torch.tensor([0.0, float("inf"), float("nan"), 3.4e38, 1e-45])
    payload = torch.tensor([0x7F800001, 0x7FBFFFFF, 0x7FC12345], dtype=torch.int32).view(torch.float32)
    both = torch.cat([base, special, payload])
    return torch.cat([both, -both])


def reference(x: torch.Tensor, fmt: str, mp: pytest.MonkeyPatch, **opts) -> tuple[torch.Tensor, torch.Tensor]:
    with mp.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        return fake_quantize(x, fmt, **opts), saturated(x, fmt, **opts)


def check(x: torch.Tensor, fmt: str, mp: pytest.MonkeyPatch, **opts) -> None:
    cfg = resolve(fmt, **{k: v for k, v in opts.items() if k not in ("amax", "scale")})
    given_scale = {k: v for k, v in opts.items() if k in ("amax", "scale")}
    assert fastpath.fp8_tensor(x, cfg, True, **given_scale) is not None  # the kernel takes it
    fast, sat = fake_quantize(x, fmt, **opts), saturated(x, fmt, **opts)
    ref, ref_sat = reference(x, fmt, mp, **opts)
    assert fast.dtype == x.dtype and fast.shape == x.shape
    differ = _bits(fast) != _bits(ref)
    assert not differ.any(), (f"{int(differ.sum())} differ, e.g. x={x[differ][:4].tolist()} "
                              f"fast={fast[differ][:4].tolist()} ref={ref[differ][:4].tolist()}")
    assert torch.equal(sat, ref_sat)
    nan_bits, _ = QNAN[x.dtype]
    assert (_bits(fast)[torch.isnan(fast)] == nan_bits).all()  # one NaN, whatever went in


FORMATS = st.sampled_from(["fp8_e4m3", "fp8_e5m2"])
OPTIONS = st.fixed_dictionaries({
    "fp8_variant": st.sampled_from(["default", "modelopt", "vllm-cpu"]),
    "rounding": st.sampled_from(["rne", "rtz"]),
    "scale_dtype": st.sampled_from(["float32", "input", "bfloat16", "float16"]),
})
SCALE_VALUES = st.one_of(st.sampled_from(SCALES), st.floats(width=32), st.floats(2.0**-20, 2.0**20, width=32))
SOURCES = st.one_of(st.just({}), SCALE_VALUES.map(lambda s: {"scale": torch.tensor(s)}),
                    SCALE_VALUES.map(lambda a: {"amax": torch.tensor(a)}))


@settings(max_examples=300, deadline=None)
@given(fmt=FORMATS, opts=OPTIONS, source=SOURCES, scale=st.sampled_from(SCALES),
       words=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=200),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_bit_identical_to_the_torch_path(fmt, opts, source, scale, words, dtype):
    """Random fp32 bit patterns (subnormals, NaN payloads, Inf) and the boundaries around each
    grid point, at a preset's scale; fp32 tensors, and bf16/fp16 ones (their values, and their
    own random bit patterns)."""
    mp = pytest.MonkeyPatch()
    x = torch.cat([torch.from_numpy(np.array(words, dtype=np.uint32).view(np.float32)),
                   boundaries(fmt, scale)])
    if dtype != torch.float32:
        half = torch.from_numpy(np.array(words, dtype=np.uint32).astype(np.uint16).view(np.int16))
        x = torch.cat([x.to(dtype), half.view(dtype)])
    check(x.reshape(-1), fmt, mp, granularity="tensor", **opts, **source)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(("fmt", "opts"), [
    ("fp8_e4m3", {"fp8_variant": "vllm-cpu", "rounding": "rtz"}),  # vllm/kv_fp8_e4m3, cpu
    ("fp8_e5m2", {"fp8_variant": "vllm-cpu", "rounding": "rtz"}),  # vllm/kv_fp8_e5m2, cpu
    ("fp8_e4m3", {}),  # vLLM's GPU backends' cache writer
    ("fp8_e4m3", {"fp8_variant": "modelopt"}),  # their query
    ("fp8_e4m3", {"scale_dtype": "input"}),  # llm-compressor/KV_FP8
])
def test_the_presets_conversions_on_a_cache(fmt, opts, scale, monkeypatch):
    """A cache-shaped tensor [batch, kv heads, tokens, head_dim] (a transposed view too) at the
    presets' scales, as a stored scale and as a calibrated amax, in fp32, bf16 and fp16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 57, 64, generator=g) * torch.logspace(-12, 3, 64) * scale
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        for source in ({"scale": torch.tensor(scale)}, {"amax": torch.tensor(scale * 448.0)}, {}):
            check(xd, fmt, monkeypatch, granularity="tensor", **opts, **source)
            check(xd.transpose(1, 2), fmt, monkeypatch, granularity="tensor", **opts, **source)


@pytest.mark.parametrize("source", [{}, {"scale": torch.tensor(0.01)}])
def test_multithreaded_is_bit_identical(source, monkeypatch):
    """Past MIN_PARALLEL elements the amax and the elements run on torch's threads."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 130, 257, generator=g) * torch.logspace(-10, 4, 257)
    x[3, 100, 7] = float("nan") if not source else x[3, 100, 7]
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check(x, "fp8_e4m3", monkeypatch, granularity="tensor", fp8_variant="vllm-cpu", rounding="rtz",
              **source)
    finally:
        torch.set_num_threads(prev)


def test_not_taken_where_it_does_not_apply(monkeypatch):
    x = torch.randn(4, 64)
    tensor = resolve("fp8_e4m3", granularity="tensor")
    assert fastpath.fp8_tensor(x, resolve("fp8_e4m3", granularity="tensor", rounding="rna"), False) is None
    assert fastpath.fp8_tensor(x, resolve("fp8_e4m3", granularity="token"), False) is None
    assert fastpath.fp8_tensor(x, resolve("int8", granularity="tensor"), False) is None
    assert fastpath.fp8_tensor(x.double(), tensor, False) is None
    assert fastpath.fp8_tensor(torch.empty(0, 64), tensor, False) is None
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    assert fastpath.fp8_tensor(x, tensor, False) is None


def test_the_torch_path_writes_the_canonical_nan_too(monkeypatch):
    """A NaN element under a given scale left torch's float8 cast as 0x7ff00000 (or copysign
    with its own sign and payload); every NaN output is 0x7fc00000 (docs/numerics.md)."""
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    nans = torch.tensor([0x7FC00000, -0x400000, 0x7F800001], dtype=torch.int32).view(torch.float32)
    for variant, rounding in (("default", "rne"), ("vllm-cpu", "rtz"), ("modelopt", "rne")):
        out = fake_quantize(nans, "fp8_e4m3", granularity="tensor", fp8_variant=variant,
                            rounding=rounding, scale=torch.tensor(1.0))
        assert out.view(torch.int32).tolist() == [0x7FC00000] * 3, (variant, rounding)


EDGE = [0.0, -0.0, float("inf"), float("nan"), 2.0**-149, 2.0**-24, 2.0**-130, 3.4e38, 70000.0, -1.0]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("variant", ["default", "modelopt", "vllm-cpu"])
@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16", "float16"])
def test_edge_scales_and_a_zero_tensor(fmt, variant, scale_dtype, monkeypatch):
    """Zero scales (the scale dtype's epsilon, or 1), infinite and NaN ones (all NaN), scales that
    a narrower scale dtype rounds to zero or Inf, negative ones; and a tensor of zeros, whose own
    amax is 0."""
    x = torch.cat([boundaries(fmt, 1.0), torch.tensor([1e-3, -250.0, 6e4])])
    opts = {"granularity": "tensor", "fp8_variant": variant, "scale_dtype": scale_dtype}
    for rounding in ("rne", "rtz"):
        for s in EDGE:
            check(x, fmt, monkeypatch, rounding=rounding, scale=torch.tensor(s), **opts)
            check(x, fmt, monkeypatch, rounding=rounding, amax=torch.tensor(s), **opts)
        zeros = torch.zeros(3, 8)
        zeros[1] = -0.0
        check(zeros, fmt, monkeypatch, rounding=rounding, **opts)
