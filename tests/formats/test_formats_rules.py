"""Every rule of NUMERICS.md on hand-made inputs: exponents, special blocks, signs, ties, blocking,
dtypes, empty tensors, gradients. Run on both the fast path and the torch reference path."""

from __future__ import annotations

import math

import pytest
import torch

from qtransform.formats import (
    block_exponents,
    decode,
    encode,
    fake_quantize,
    names,
    saturated,
)
from qtransform.formats.elements import ceil_log2, floor_log2, pow2

NAN = float("nan")
INF = float("inf")
MX = [n for n in names() if n.startswith("mx")]
VARIANTS = [("nvfp4", {"nvfp4_variant": v}) for v in ("default", "compressed-tensors", "one_level")]
ALL_CONFIGS = [(f, {}) for f in names() if f != "nvfp4"] + VARIANTS


@pytest.fixture(params=["fast", "reference"], autouse=True)
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    return request.param


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b)), f"\n{a}\n!=\n{b}"


def f32(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def test_floor_log2_is_exact():
    below = torch.nextafter(f32(8.0, 4.0, 1.0, 2.0**-126), f32(0.0))
    assert floor_log2(below).tolist() == [2, 1, -1, -127]
    sub = f32(2.0**-149, 2.0**-140, 3 * 2.0**-149)
    assert floor_log2(sub).tolist() == [-149, -140, -148]
    assert ceil_log2(f32(8.0, 7.9999995, 2.0**-149, 3 * 2.0**-149)).tolist() == [3, 3, -149, -147]
    k = torch.arange(-149, 128)
    assert torch.equal(pow2(k), torch.tensor([math.ldexp(1.0, int(i)) for i in k]))


def test_amax_just_below_a_power_of_two():
    x = torch.zeros(32)
    x[0] = 7.9999995  # floor(log2(x)) would say 3; the exact exponent is 2
    assert block_exponents(x, "mxfp4").item() == 0
    assert fake_quantize(x, "mxfp4")[0].item() == 6.0


def test_smallest_scale_is_used_both_ways():
    x = torch.zeros(32)
    x[:4] = f32(1.5, 0.5, -1.0, 6.0) * 2.0**-127  # amax 6 * 2^-127: E = -127 after the clamp
    out = fake_quantize(x, "mxfp4")
    assert_bits(out, x)
    assert block_exponents(x, "mxfp4").item() == -127
    assert encode(x, "mxfp4").scales.item() == 0


def test_exponent_clamped_at_both_ends():
    big = torch.full((32,), 3.0e38)
    assert block_exponents(big, "mxint8").item() == 127
    assert block_exponents(big, "mxint8", scale_rule="even").item() == 127
    tiny = torch.full((32,), 2.0**-149)
    assert block_exponents(tiny, "mxfp8_e5m2").item() == -127
    assert block_exponents(tiny, "mxfp4", scale_rule="rceil").item() == -127  # quotient underflows


@pytest.mark.parametrize(("fmt", "opts"), [(f, {}) for f in MX] + [("int4", {}), ("int8", {})])
@pytest.mark.parametrize("special", [NAN, INF, -INF])
def test_nan_or_inf_makes_only_its_block_nan(fmt, opts, special):
    x = torch.randn(4, 64)
    x[1, 3] = special
    out = fake_quantize(x, fmt, block_size=32, **opts)
    assert torch.isnan(out[1, :32]).all()
    assert not torch.isnan(out[1, 32:]).any() and not torch.isnan(out[[0, 2, 3]]).any()
    assert_bits(out[1, :32], torch.full((32,), NAN))  # canonical NaN bits
    if fmt.startswith("mx"):
        assert encode(x, fmt, block_size=32).scales.view(4, 2)[1, 0].item() == 0xFF
        assert block_exponents(x, fmt, block_size=32)[1, 0].item() == 128


def test_nvfp4_special_values_follow_the_formula():
    x = torch.randn(2, 32)
    x[0, 5] = NAN
    assert torch.isnan(fake_quantize(x, "nvfp4")).all()  # tensor amax NaN: everything NaN
    one = fake_quantize(x, "nvfp4", nvfp4_variant="one_level")
    assert torch.isnan(one[0, :16]).all() and not torch.isnan(one[0, 16:]).any()
    ct = fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors")
    assert torch.isnan(ct[0, :16]).all() and not torch.isnan(ct[0, 16:]).any()
    x[0, 5] = INF
    out = fake_quantize(x, "nvfp4")  # g = 2688 / inf = 0 -> 1: the Inf becomes 6 * 448
    assert out[0, 5].item() == 2688.0 and not torch.isnan(out).any()
    assert torch.isnan(fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors")).all()


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_zero_blocks_keep_signed_zeros(fmt, opts):
    x = torch.zeros(2, 256)
    x[0, ::3] = -0.0
    out = fake_quantize(x, fmt, **opts)
    if opts.get("nvfp4_variant") == "compressed-tensors":
        assert_bits(out, torch.zeros_like(x))  # that library turns -0 into +0
    else:
        assert_bits(out, x)
    if fmt.startswith("mx"):
        assert (encode(x, fmt).scales == 0).all() and (block_exponents(x, fmt) == -127).all()


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_small_negatives_round_to_negative_zero(fmt, opts):
    x = torch.zeros(256)
    x[0] = 100.0
    x[1:5] = f32(-1e-12, -0.0, 1e-12, -1e-30)
    out = fake_quantize(x, fmt, **opts)
    expect = [-0.0, -0.0, 0.0, -0.0]
    if opts.get("nvfp4_variant") == "compressed-tensors":
        expect[1] = 0.0
    assert_bits(out[1:5], f32(*expect))


def test_fp32_subnormals():
    x = f32(*[k * 2.0**-149 for k in range(1, 33)])
    out = fake_quantize(x, "mxfp8_e4m3")
    # amax = 32 * 2^-149 = 2^-144: E clamps to -127, elements are tiny fractions of the grid
    y = x / 2.0**-127
    assert torch.equal(out, torch.round(y / 2.0**-9) * 2.0**-9 * 2.0**-127)
    assert_bits(decode(encode(x, "mxfp8_e4m3")), out)
    assert (fake_quantize(x * 2.0**100, "mxfp4") != 0).any()


E2M1_TIES = f32(0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 4.0)


@pytest.mark.parametrize(("rounding", "expect"), [
    ("rne", [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, 4.0]),
    ("rna", [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -3.0, 4.0]),
])
def test_e2m1_ties(rounding, expect):
    x = torch.zeros(32)
    x[:10] = E2M1_TIES  # amax 5: E = 0, the scale is 1
    assert_bits(fake_quantize(x, "mxfp4", rounding=rounding)[:10], f32(*expect))


def test_int_group_ties_and_saturation():
    x = torch.zeros(128)
    x[:4] = f32(7.0, 2.5, -3.5, 0.5)  # scale 1
    assert fake_quantize(x, "int4")[:4].tolist() == [7.0, 2.0, -4.0, 0.0]
    assert fake_quantize(x, "int4", rounding="rna")[:4].tolist() == [7.0, 3.0, -4.0, 1.0]


def test_saturation_and_mask():
    x = torch.zeros(32)
    x[:4] = f32(7.0, -6.5, 5.9, 6.0)  # amax 7: E = 0, 7 and 6.5 clip at 6
    assert fake_quantize(x, "mxfp4")[:4].tolist() == [6.0, -6.0, 6.0, 6.0]
    mask = saturated(x, "mxfp4")
    assert mask[:4].tolist() == [True, True, False, False] and not mask[4:].any()
    assert not saturated(x, "mxfp4", scale_rule="rceil").any()  # rceil never saturates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("fmt", "opts"), [("mxfp4", {}), ("mxfp8_e5m2", {}), *VARIANTS,
                                           ("int8", {})])
def test_dtypes_compute_in_fp32(dtype, fmt, opts):
    x = (torch.randn(6, 96) * 3).to(dtype)
    out = fake_quantize(x, fmt, **opts)
    assert out.dtype == dtype
    assert_bits(out, fake_quantize(x.float(), fmt, **opts).to(dtype))


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_ragged_rows_are_padded_per_row(fmt, opts):
    x = torch.randn(3, 40)
    x[1, 35] = 1000.0  # would leak into row 0's tail block if blocks straddled rows
    out = fake_quantize(x, fmt, block_size=32 if fmt != "nvfp4" else 16, **opts)
    for r in range(3):
        padded = torch.zeros(1, 64)
        padded[0, :40] = x[r]
        if fmt == "nvfp4":
            padded[0, 48] = x.abs().max()  # the whole tensor's amax, in a block of its own
        ref = fake_quantize(padded, fmt, block_size=32 if fmt != "nvfp4" else 16, **opts)
        assert_bits(out[r], ref[0, :40])


@pytest.mark.parametrize(("fmt", "opts"), [(f, {}) for f in MX] + VARIANTS)
def test_2d_tiles_with_ragged_edges(fmt, opts):
    tile = (16, 16) if fmt == "nvfp4" else (32, 32)
    x = torch.randn(2, 40, 50)
    x[1, 39, 49] = 500.0
    out = fake_quantize(x, fmt, block_shape=tile, **opts)
    big = torch.zeros(2, 3 * tile[0], 4 * tile[1])
    big[:, :40, :50] = x
    blocks = big.reshape(2, 3, tile[0], 4, tile[1]).transpose(2, 3).reshape(-1, tile[0] * tile[1])
    ref = fake_quantize(blocks, fmt, block_size=tile[0] * tile[1], **opts)
    ref = ref.reshape(2, 3, 4, *tile).transpose(2, 3).reshape(2, 3 * tile[0], 4 * tile[1])
    assert_bits(out, ref[:, :40, :50])
    if fmt.startswith("mx"):
        assert block_exponents(x, fmt, block_shape=tile).shape == (2, 2, 2)


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_other_axes(fmt, opts):
    x = torch.randn(48, 5, 33)
    assert_bits(fake_quantize(x, fmt, axis=0, **opts),
                fake_quantize(x.movedim(0, -1), fmt, **opts).movedim(-1, 0))
    assert_bits(fake_quantize(x, fmt, axis=-2, **opts),
                fake_quantize(x.transpose(1, 2), fmt, **opts).transpose(1, 2))
    assert fake_quantize(x.transpose(0, 2), fmt, **opts).shape == (33, 5, 48)  # non-contiguous


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
@pytest.mark.parametrize("shape", [(0,), (0, 32), (4, 0), (2, 0, 3)])
def test_empty_tensors(fmt, opts, shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    out = fake_quantize(x, fmt, **opts)
    assert out.shape == shape and out.dtype == torch.bfloat16
    assert decode(encode(x, fmt, **opts)).shape == shape
    assert saturated(x, fmt, **opts).shape == shape


def test_zero_dim_tensor():
    assert fake_quantize(torch.tensor(3.3), "mxfp4").item() == 3.0
    assert block_exponents(torch.tensor(3.3), "mxfp4").shape == ()


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_straight_through_gradient(fmt, opts):
    x = (torch.randn(4, 64) * 4).requires_grad_()
    g = torch.randn(4, 64)
    fake_quantize(x, fmt, **opts).backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS)
def test_zero_saturated_grad(fmt, opts):
    x = torch.randn(4, 256) * 4
    x[0, :5] = f32(7.0, -6.5, 5.9, 100.0, -1e-3)
    xg = x.clone().requires_grad_()
    fake_quantize(xg, fmt, zero_saturated_grad=True, **opts).sum().backward()
    mask = saturated(x, fmt, **opts)
    assert torch.equal(xg.grad, (~mask).float())
    if fmt == "mxfp4":
        assert mask[0, :5].tolist() == [False, False, False, True, False]  # 100 / 2^4 > 6
        y = torch.zeros(32)
        y[:3] = f32(7.0, 6.5, 1.0)
        yg = y.clone().requires_grad_()
        fake_quantize(yg, fmt, zero_saturated_grad=True).sum().backward()
        assert yg.grad[:4].tolist() == [0.0, 0.0, 1.0, 1.0]


def test_grad_dtype_follows_input():
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    fake_quantize(x, "nvfp4").sum().backward()
    assert x.grad.dtype == torch.bfloat16 and (x.grad == 1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("fmt", "opts"), ALL_CONFIGS + [("mxfp4", {"scale_rule": "rceil"}),
                                                         ("mxfp6_e3m2", {"scale_rule": "even"})])
def test_cuda_matches_cpu(fmt, opts):
    x = torch.randn(33, 300) * torch.logspace(-20, 20, 300)
    x[3, 7] = NAN
    x[5, :40] = -0.0
    cpu = fake_quantize(x, fmt, **opts)
    gpu = fake_quantize(x.cuda(), fmt, **opts)
    assert gpu.device.type == "cuda"
    assert_bits(gpu.cpu(), cpu)
    assert_bits(decode(encode(x.cuda(), fmt, **opts)).cpu(), cpu)
