"""The compiled FP4 export passes (`tensors.fp4_stored`, qfast.c `qf_nvfp4_pack` in its
compressed-tensors and ModelOpt orders, and `qf_mxfp4_pack`) write the same bytes as the
reference path (`weight_chunks` -> E2M1 codes -> nibbles, E4M3 scales and g or d, or E8M0
exponents)."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.checkpoints.packing import e2m1_codes, pack_nibbles
from qtransform.formats import QuantConfig, fastpath
from qtransform.formats import stored as T


@pytest.fixture(scope="module", autouse=True)
def lib():
    """The built library; a skip only where no compiler exists (then it cannot build)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("compiled export pass not testable here: no C compiler (cc/gcc) on PATH")
    assert fastpath.library() is not None, f"a compiler is installed, so the fast path must build: {fastpath.unavailable_reason()}"

SCALE_DTYPES = ["float32", "bfloat16", "float16", "input"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config(scale_dtype: str) -> QuantConfig:
    """("input": the weight's own dtype, bound where the scales are computed)"""
    return QuantConfig.from_options("nvfp4", {"nvfp4_variant": "compressed-tensors",
                                              "scale_dtype": scale_dtype}).bind(-1)


def reference(w: torch.Tensor, cfg: QuantConfig, amax: torch.Tensor | None):
    """The bytes of the reference path, chunk by chunk, as the writer stored them before."""
    rows, cols = w.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // 16, dtype=torch.float8_e4m3fn)
    g = None
    for chunk in T.weight_chunks(w, cfg, amax):
        part = slice(chunk.start, chunk.start + chunk.elements.shape[0])
        packed[part] = pack_nibbles(e2m1_codes(chunk.elements))
        scales[part] = chunk.scales.to(torch.float8_e4m3fn)
        g = chunk.tensor_scale
    return packed, scales, g


def assert_same(w: torch.Tensor, cfg: QuantConfig, amax: torch.Tensor | None = None) -> None:
    fast = T.fp4_stored(w, cfg, amax)
    assert fast is not None
    packed, scales, g = reference(w, cfg, amax)
    assert torch.equal(fast[0], packed)
    assert torch.equal(fast[1].view(torch.uint8), scales.view(torch.uint8))
    assert fast[2].dtype == torch.float32 and fast[2].item() == g.item()


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_block_amax_of_a_16_bit_weight(scale_dtype, dtype):
    """Each finite positive 16-bit value once as a block's amax (row r: that value, its negation
    and fractions of it), under one tensor amax: every division `sixth` and every scale. (bf16
    amaxes stop at 2^126: above, the reference's dequantized values overflow bf16 and its codes
    of those infinities are not E2M1 codes; the kernel stores the finite codes.)"""
    dt = DTYPES[dtype]
    top = 0x7800 if dt == torch.float16 else 0x4780 if scale_dtype == "float16" else 0x7E80
    bits = torch.arange(1, top, dtype=torch.int32)  # 0x4780: fp16 scale divisions stay finite
    amax_b = bits.to(torch.int16).view(dt).to(torch.float32)
    frac = torch.linspace(-1.0, 1.0, 16)
    w = (amax_b[:, None] * frac).to(dt)
    w[:, 0] = amax_b.to(dt)  # the amax itself, exactly
    assert_same(w, config(scale_dtype), torch.tensor(float(amax_b.max())))
    assert_same(w[-4096:].contiguous(), config(scale_dtype))  # its own amax


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), blocks=st.integers(1, 9),
       magnitude=st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]), zeros=st.booleans(),
       amax_scale=st.sampled_from([None, 1.0, 3.5]))
def test_the_kernel_equals_the_reference(scale_dtype, dtype, seed, rows, blocks, magnitude, zeros,
                                         amax_scale):
    dt = DTYPES[dtype]
    if torch.float16 in (dt, DTYPES.get(scale_dtype)):  # within its range (subnormals at 1e-6)
        magnitude = min(max(magnitude, 1e-6), 1e3)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, 16 * blocks, generator=g) * magnitude).to(dt)
    if zeros:
        w[0, :16] = 0.0  # a zero block
        w[-1, -1] = -0.0
    amax = None if amax_scale is None else T.tensor_amax(w) * amax_scale  # a scale group's amax
    if amax is not None and amax == 0:
        amax = None
    assert_same(w, config(scale_dtype), amax)


def test_an_all_zero_weight():
    w = torch.zeros(3, 32, dtype=torch.bfloat16)
    w[1] = -0.0
    assert_same(w, config("bfloat16"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_take_the_reference_path(bad):
    w = torch.randn(4, 32, dtype=torch.bfloat16)
    w[2, 5] = bad
    assert T.fp4_stored(w, config("bfloat16"), torch.tensor(4.0)) is None


def test_layouts_the_kernel_does_not_cover():
    w = torch.randn(4, 40)  # not whole blocks of 16
    assert T.fp4_stored(w, QuantConfig.from_options("nvfp4", {"nvfp4_variant": "compressed-tensors"}).bind(-1),
                          None) is None
    default = QuantConfig.from_options("nvfp4", {"nvfp4_variant": "default"}).bind(-1)
    assert T.fp4_stored(torch.randn(4, 32), default, None) is None  # NVIDIA's order: torch path
    assert T.fp4_stored(torch.randn(4, 40), MODELOPT, None) is None


MODELOPT = QuantConfig.from_options("nvfp4", {"nvfp4_variant": "modelopt"}).bind(-1)


def modelopt_reference(w: torch.Tensor, amax: torch.Tensor | None):
    """The bytes ModelOpt's layout stores from the reference path (modelopt.py before the
    kernel): E2M1 magnitudes with the sign bit of `w < 0`, E4M3 scales, the decode scale d."""
    rows, cols = w.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // 16, dtype=torch.float8_e4m3fn)
    d = None
    for chunk in T.weight_chunks(w, MODELOPT, amax):
        part = slice(chunk.start, chunk.start + chunk.elements.shape[0])
        codes = e2m1_codes(chunk.elements.abs()) | ((w[part] < 0).to(torch.uint8) << 3)
        packed[part] = pack_nibbles(codes)
        scales[part] = chunk.scales.to(torch.float8_e4m3fn)
        d = chunk.tensor_scale
    return packed, scales, d


def assert_same_modelopt(w: torch.Tensor, amax: torch.Tensor | None = None) -> None:
    fast = T.fp4_stored(w, MODELOPT, amax)
    assert fast is not None
    packed, scales, d = modelopt_reference(w, amax)
    assert torch.equal(fast[0], packed)
    assert torch.equal(fast[1].view(torch.uint8), scales.view(torch.uint8))
    assert fast[2].dtype == torch.float32 and fast[2].item() == d.item()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_block_amax_of_a_16_bit_weight_modelopt(dtype):
    """ModelOpt's order on each finite positive 16-bit value as a block's amax, under the largest
    as the tensor amax (scales clamped up to 2^-9 at the bottom) and under its own."""
    dt = DTYPES[dtype]
    bits = torch.arange(1, 0x7C00 if dt == torch.float16 else 0x7F80, dtype=torch.int32)
    amax_b = bits.to(torch.int16).view(dt).to(torch.float32)
    w = (amax_b[:, None] * torch.linspace(-1.0, 1.0, 16)).to(dt)
    w[:, 0] = amax_b.to(dt)
    assert_same_modelopt(w, torch.tensor(float(amax_b.max())))
    assert_same_modelopt(w[-4096:].contiguous())
    assert_same_modelopt(w[:4096].contiguous())  # tiny weights: d near fp32's smallest


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), blocks=st.integers(1, 9),
       magnitude=st.sampled_from([1e-30, 1e-6, 1.0, 1e3, 1e30]), zeros=st.booleans(),
       amax_scale=st.sampled_from([None, 1.0, 3.5, 1e4]))
def test_the_modelopt_kernel_equals_the_reference(dtype, seed, rows, blocks, magnitude, zeros, amax_scale):
    dt = DTYPES[dtype]
    if dt == torch.float16:
        magnitude = min(max(magnitude, 1e-6), 1e3)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, 16 * blocks, generator=g) * magnitude).to(dt)
    if zeros:
        w[0, :16] = 0.0  # a zero block: s = 1
        w[-1, -1] = -0.0  # stored as +0 (not negative)
        w[-1, 0] = -float(T.tensor_amax(w)) * 1e-3  # negative, rounds to zero: code 8
    amax = None if amax_scale is None else T.tensor_amax(w) * amax_scale
    if amax is not None and amax == 0:
        amax = None
    assert_same_modelopt(w, amax)


def test_modelopt_zero_and_non_finite_weights():
    w = torch.zeros(3, 32, dtype=torch.bfloat16)
    w[1] = -0.0
    assert_same_modelopt(w)  # amax 0: d = 1, every block s = 1
    w = torch.randn(4, 32, dtype=torch.bfloat16)
    w[2, 5] = float("nan")
    assert T.fp4_stored(w, MODELOPT, torch.tensor(4.0)) is None


def mx_reference(w: torch.Tensor, cfg: QuantConfig):
    rows, cols = w.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // 32, dtype=torch.uint8)
    for chunk in T.weight_chunks(w, cfg, None):
        part = slice(chunk.start, chunk.start + chunk.elements.shape[0])
        packed[part] = pack_nibbles(e2m1_codes(chunk.elements))
        scales[part] = chunk.scales.to(torch.uint8)
    return packed, scales


@pytest.mark.parametrize("rule", ["floor", "ceil", "rceil", "even", "compressed-tensors"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), blocks=st.integers(1, 5),
       magnitude=st.sampled_from([1e-40, 1e-6, 1.0, 1e3, 1e30]), zeros=st.booleans())
def test_the_mxfp4_kernel_equals_the_reference(rule, dtype, seed, rows, blocks, magnitude, zeros):
    dt = DTYPES[dtype]
    if dt == torch.float16:
        magnitude = min(max(magnitude, 1e-6), 1e3)
    cfg = QuantConfig.from_options("mxfp4", {"scale_rule": rule}).bind(-1)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, 32 * blocks, generator=g) * magnitude).to(dt)
    if zeros:
        w[0, :32] = 0.0  # a zero block
        w[-1, -1] = -0.0
    fast = T.fp4_stored(w, cfg, None)
    assert fast is not None and fast[2] is None
    packed, scales = mx_reference(w, cfg)
    assert torch.equal(fast[0], packed)
    assert torch.equal(fast[1], scales)


def test_every_mxfp4_block_amax_of_bf16():
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)
    amax_b = bits.to(torch.int16).view(torch.bfloat16).to(torch.float32)
    w = (amax_b[:, None] * torch.linspace(-1.0, 1.0, 32)).to(torch.bfloat16)
    w[:, 0] = amax_b.to(torch.bfloat16)
    cfg = QuantConfig.from_options("mxfp4", {}).bind(-1)
    fast = T.fp4_stored(w, cfg, None)
    assert fast is not None
    packed, scales = mx_reference(w, cfg)
    assert torch.equal(fast[0], packed)
    assert torch.equal(fast[1], scales)
