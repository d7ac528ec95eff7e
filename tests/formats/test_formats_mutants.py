"""Pins found by mutation testing of the formats group (docs/testing.md).

Each test kills one or more mutants that survived `benches/mutation.sh formats`; the expected
values are worked out by hand or in float64 in the test, never taken from the code under test.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from qtransform.formats import encode, fake_quantize, saturated
from qtransform.formats.blocking import BlockLayout, make_layout, tensor_amax
from qtransform.formats.elements import (
    code_table,
    decode_elements,
    encode_elements,
    pow2,
    round_magnitude,
    round_signed,
    round_to_integer,
    twos_complement,
)
from qtransform.formats.mx import shared_exponent
from qtransform.formats.nvfp4 import quantize_nvfp4, scale_values
from qtransform.formats.options import resolve
from qtransform.formats.registry import E2M1, INT4, INT8, INT8_MX


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class _DefaultDtype:
    """Run a block with float64 as torch's default dtype (restored afterwards)."""

    def __enter__(self) -> None:
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.old)


# ---- elements ---------------------------------------------------------------------------------


def test_round_defaults_are_rne() -> None:
    """round_magnitude / round_signed default to ties-to-even: 2.5 lies halfway between the E2M1
    points 2 and 3 (step 1 in [2, 4)), so it goes to the even significand 2 (hand-worked)."""
    assert round_magnitude(torch.tensor([2.5, 0.75]), E2M1).tolist() == [2.0, 1.0]
    assert round_signed(torch.tensor([-2.5, -0.25]), E2M1).tolist() == [-2.0, -0.0]


def test_stochastic_without_draws_names_the_problem() -> None:
    """Stochastic rounding with u=None fails with the message that says what is missing."""
    with pytest.raises(AssertionError, match="^stochastic rounding needs uniform draws$"):
        round_to_integer(torch.tensor([0.5]), "stochastic", None)


def test_code_table_default_device_length_and_dtype() -> None:
    """code_table(E2M1) with the default device: 2^(4-1) = 8 codes, the hand-listed E2M1
    magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; fp32 even when torch's default dtype is float64."""
    t = code_table(E2M1)
    assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    int4 = code_table(INT4)  # 1 + bit_length(7) = 4 bits: 8 codes 0..7
    assert int4.tolist() == [float(i) for i in range(8)]
    with _DefaultDtype():
        assert code_table(E2M1).dtype == torch.float32


def test_pow2_bit_patterns() -> None:
    """2^k built from bits at both ends of each branch: 2^-149 is bits 0x1, 2^-127 the subnormal
    0x00400000, 2^-126 the smallest normal 0x00800000, 2^0 0x3F800000, 2^127 0x7F000000."""
    k = torch.tensor([-149, -128, -127, -126, 0, 127])
    bits = [0x00000001, 0x00200000, 0x00400000, 0x00800000, 0x3F800000, 0x7F000000]
    assert pow2(k).view(torch.int32).tolist() == bits


def test_tables_follow_the_device_asked_for() -> None:
    """code_table, decode/encode_elements and tensor_amax (empty input) put their results on the
    device they are given or the input's: the meta device shows it without a GPU."""
    meta = torch.device("meta")
    assert code_table(E2M1, meta).device == meta
    assert decode_elements(torch.zeros(3, dtype=torch.uint8, device=meta), E2M1).device == meta
    assert encode_elements(torch.zeros(3, device=meta), E2M1).device == meta
    assert tensor_amax(torch.zeros(0, device=meta)).device == meta


def test_encode_nan_gets_code_zero() -> None:
    """A NaN element encodes as code 0 (its block scale carries the NaN), not as the code of
    1.0 (0b0010) nor with a sign bit: NUMERICS.md's encode rule, hand-worked codes."""
    codes = encode_elements(torch.tensor([float("nan"), 1.0, -6.0]), E2M1)
    assert codes.tolist() == [0, 0b0010, 0b1111]


def test_twos_complement_is_int8() -> None:
    """INT4 sign-magnitude codes 0b1011 (-3), 0b0011 (3), 0b1000 (-0) -> int8 -3, 3, 0."""
    out = twos_complement(torch.tensor([0b1011, 0b0011, 0b1000], dtype=torch.uint8), INT4)
    assert out.dtype == torch.int8
    assert out.tolist() == [-3, 3, 0]
    int8 = twos_complement(torch.tensor([0xFF, 0x7F, 0x80, 0x81], dtype=torch.uint8), INT8)
    assert int8.dtype == torch.int8
    assert int8.tolist() == [-127, 127, 0, -1]


# ---- blocking ---------------------------------------------------------------------------------


def test_make_layout_tile_fields() -> None:
    """A tiled layout is BlockLayout(shape, ndim - 1, 0, tile), each tile side cut to its dim:
    (5, 4, 6) with tile (2, 8) -> axis 2, block 0, tile (min(2, 4), min(8, 6)) = (2, 6)."""
    assert make_layout((5, 4, 6), -1, 32, (2, 8)) == BlockLayout((5, 4, 6), 2, 0, (2, 6))
    assert make_layout((4, 6), 0, 32, (2, 3)) == BlockLayout((4, 6), 1, 0, (2, 3))
    assert make_layout((4, 6), 0, 32, (8, 2)) == BlockLayout((4, 6), 1, 0, (4, 2))


def test_make_layout_tile_on_size_one_and_zero_dims() -> None:
    """Tile sides are cut to max(dim, 1): a dim of 1 gives a side of 1, a dim of 0 too."""
    assert make_layout((1, 6), -1, 32, (2, 3)).tile == (1, 3)
    assert make_layout((4, 1), -1, 32, (2, 3)).tile == (2, 1)
    assert make_layout((0, 0), -1, 32, (2, 3)).tile == (1, 1)


def test_make_layout_1d_block_cut_to_dim() -> None:
    """A 1D block is cut to max(dim, 1): dim 1 -> block 1, dim 0 -> block 1; tile is None."""
    assert make_layout((1,), -1, 32, None) == BlockLayout((1,), 0, 1, None)
    assert make_layout((3, 0), 1, 32, None) == BlockLayout((3, 0), 1, 1, None)
    assert make_layout((3, 5), 0, 2, None) == BlockLayout((3, 5), 0, 2, None)


def test_tensor_amax_is_fp32() -> None:
    """tensor_amax returns fp32 for an fp16 tensor and for an empty one, whatever torch's
    default dtype: max |[-3, 2]| = 3 exactly; empty gives 0."""
    a = tensor_amax(torch.tensor([-3.0, 2.0], dtype=torch.float16))
    assert a.dtype == torch.float32 and a.item() == 3.0
    with _DefaultDtype():
        e = tensor_amax(torch.zeros(0, dtype=torch.float16))
    assert e.dtype == torch.float32 and e.item() == 0.0


# ---- mx.shared_exponent -----------------------------------------------------------------------


def test_shared_exponent_unknown_rule_message() -> None:
    """An unknown scale rule is rejected with a message naming it."""
    with pytest.raises(ValueError, match="unknown scale_rule 'bogus'"):
        shared_exponent(torch.tensor([1.0]), E2M1, "bogus")


def test_shared_exponent_clamped_at_127() -> None:
    """E is clamped to the E8M0 maximum 127: for INT8_MX (emax 0) and amax = FLT_MAX,
    ceil(log2 FLT_MAX) = 128 and 'even' rounds FLT_MAX up to 2^128, both 128 - 0 -> 127."""
    amax = torch.tensor([f32_from_bits(0x7F7FFFFF)])
    assert shared_exponent(amax, INT8_MX, "ceil").tolist() == [127]
    assert shared_exponent(amax, INT8_MX, "even").tolist() == [127]
    assert shared_exponent(amax, INT8_MX, "floor").tolist() == [127]


def test_shared_exponent_even_rounds_up_into_overflow() -> None:
    """'even' with E2M1 (1 mantissa bit) rounds amax to 2 significant bits, half up. amax with
    bits 0x7F600000 = 1.75 * 2^127 (float64: math.ldexp(1.75, 127)) rounds to 2^128, whose bits
    are past the finite range: E = 128 - emax(2) = 126. One step below, 0x7F5FFFFF rounds to
    1.5 * 2^127: E = 127 - 2 = 125."""
    top = f32_from_bits(0x7F600000)
    assert top == math.ldexp(1.75, 127)
    below = f32_from_bits(0x7F5FFFFF)
    assert shared_exponent(torch.tensor([top, below]), E2M1, "even").tolist() == [126, 125]


# ---- intgroup ---------------------------------------------------------------------------------


def test_int_saturation_mask() -> None:
    """int4: amax 7 gives scale 1, so 7 / 1 = 7 is not beyond qmax 7 (not saturated) and no
    other element is; NaN groups count as not saturated (docs of `saturated`)."""
    x = torch.tensor([7.0, -3.0, 1.0, 0.5])
    assert not saturated(x, "int4", block_size=4).any()
    xn = torch.tensor([float("nan"), 1.0, 2.0, 3.0, 7.0, -7.0, 1.0, 1.0])
    assert not saturated(xn, "int4", block_size=4).any()


def test_int_saturation_from_scale_rounding() -> None:
    """A group whose fp32 scale fl32(amax / 7) rounds down makes amax / scale > 7: that element
    is saturated. The amax is searched in float64 with numpy-free struct rounding to fp32."""

    def fl32(v: float) -> float:
        return struct.unpack("<f", struct.pack("<f", v))[0]

    amax = next(a for a in (fl32(1.0 + i / 1000) for i in range(1, 1000))
                if fl32(a / fl32(a / 7.0)) > 7.0)
    x = torch.tensor([amax, 1.0, -0.5, 0.0])
    assert saturated(x, "int4", block_size=4).tolist() == [True, False, False, False]


# ---- nvfp4 ------------------------------------------------------------------------------------


def test_one_level_unit_scale_keeps_grid_values() -> None:
    """one_level with block amax 6: s = e4m3(6 / 6) = 1, so every E2M1 grid value comes back
    unchanged (hand-worked), under rne and under stochastic rounding (an exact grid value t has
    floor(t + u) = t for u in [0, 1))."""
    x = torch.tensor([6.0, -3.0, 1.5, 0.5, -0.0, 2.0, 4.0, -1.0] * 2)
    for rounding in ("rne", "stochastic"):
        out = fake_quantize(x, "nvfp4", nvfp4_variant="one_level", rounding=rounding, seed=1)
        assert torch.equal(out, x), rounding
    assert not saturated(x, "nvfp4", nvfp4_variant="one_level").any()  # y = 6 is not > 6


def test_one_level_saturation_between_6_and_7() -> None:
    """one_level, amax 6.3: s = e4m3_rne(6.3 / 6 = 1.05) = 1 (step 1/8 in [1, 2)), y = 6.3 > 6:
    saturated, and it fake-quantizes to 6."""
    x = torch.tensor([6.3] + [1.0] * 15)
    assert saturated(x, "nvfp4", nvfp4_variant="one_level").tolist() == [True] + [False] * 15
    assert fake_quantize(x, "nvfp4", nvfp4_variant="one_level")[0].item() == 6.0


def test_compressed_tensors_zero_tensor_scales() -> None:
    """compressed-tensors on an all-zero tensor: g = 2688 / 0 is not finite and falls back to 1,
    the zero block scale falls back to 0.125 (NUMERICS.md, hand-worked)."""
    enc = encode(torch.zeros(16), "nvfp4", nvfp4_variant="compressed-tensors")
    assert enc.tensor_scale is not None and enc.tensor_scale.item() == 1.0
    assert enc.scales.float().tolist() == [0.125]


def test_compressed_tensors_zero_block_scale_in_mixed_tensor() -> None:
    """compressed-tensors, tensor amax 1000 (g = 2.688): a block of 1e-3 has
    g * 1e-3 / 6 = 4.5e-4 < 2^-10 (half the smallest E4M3 subnormal), so its E4M3 scale is 0
    and falls back to 0.125; its elements round to 0."""
    x = torch.cat([torch.full((16,), 1000.0), torch.full((16,), 1e-3)])
    enc = encode(x, "nvfp4", nvfp4_variant="compressed-tensors")
    assert enc.scales.float()[1].item() == 0.125
    assert fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors")[16:].abs().max() == 0


@pytest.fixture(params=["0", "1"], ids=["reference", "fastpath"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the reference path and on the C fast path (where it builds)."""
    monkeypatch.setenv("QTRANSFORM_FASTPATH", request.param)
    return request.param


def test_default_zero_block_scale_with_large_elements(path: str) -> None:
    """NVIDIA's order, tensor amax 1e6 (g = fl32(2688 / 1e6)): a block of +-2 has
    2 * g / 6 = 8.96e-4 < 2^-10 (9.77e-4), so s = 0, enc = min(1 / 0, FLT_MAX) = FLT_MAX and
    y = +-2 * FLT_MAX = +-Inf. clamp(y, -6, 6) makes both q = +-6 (codes 0b0111, 0b1111,
    saturated) and the output q * 0 = +-0; without the lower bound -Inf would round to NaN."""
    x = torch.cat([torch.full((16,), 1e6), torch.tensor([2.0, -2.0] * 8)])
    out = fake_quantize(x, "nvfp4")
    assert out[16:].tolist() == [0.0] * 16
    assert torch.signbit(out[16:]).tolist() == [False, True] * 8
    assert saturated(x, "nvfp4")[16:].all()
    if path == "0":
        assert encode(x, "nvfp4").codes[1].tolist() == [0b0111, 0b1111] * 8
        assert encode(x, "nvfp4").scales.tolist() == [448.0, 0.0]


def test_one_level_infinities_saturate(path: str) -> None:
    """one_level, a block with +-Inf: s = e4m3(min(Inf / 6, 448)) = 448, y = +-Inf / 448 =
    +-Inf clamps to +-6, so Inf -> 6 * 448 = 2688 and -Inf -> -2688 (not NaN); 224 / 448 = 0.5
    is on the E2M1 grid: 224 comes back."""
    x = torch.tensor([float("-inf"), float("inf"), 224.0] + [0.0] * 13)
    out = fake_quantize(x, "nvfp4", nvfp4_variant="one_level")
    assert out[:3].tolist() == [-2688.0, 2688.0, 224.0]


def test_compressed_tensors_infinities_beside_a_nan(path: str) -> None:
    """compressed-tensors, NaN in block 0 and +-Inf in block 1: the tensor amax is NaN, so
    g = 1; block 1 has s = e4m3(Inf / 6) = 448 (E4M3 rounding saturates Inf), scale 448 / 1,
    y = +-Inf clamps to +-6: -Inf -> -2688, Inf -> 2688, 448 -> 448 (y = 1). Block 0 is NaN."""
    inf = float("inf")
    x = torch.tensor([float("nan")] + [1.0] * 15 + [-inf, inf, 448.0] + [0.0] * 13)
    out = fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors")
    assert torch.isnan(out[:16]).all()
    assert out[16:19].tolist() == [-2688.0, 2688.0, 448.0]


def test_one_level_zero_scale_elements_are_zero_under_stochastic_rounding() -> None:
    """one_level, block amax 6 * 2^-10: amax / 6 = 2^-10 is half the smallest E4M3 subnormal
    and ties to even give s = 0, so every element is 0 (code 0), whatever the draws. Scaled
    as x / 1 instead, y = 6 * 2^-10 would round up to 0.5 (code 1) whenever u >= 1 - y / 0.5,
    about 1.2 % of 1024 draws."""
    x = torch.full((1024,), 6 * 2.0**-10)
    enc = encode(x, "nvfp4", nvfp4_variant="one_level", rounding="stochastic", seed=3)
    assert enc.scales.tolist() == [0.0] * 64
    assert enc.codes.unique().tolist() == [0]


def test_two_level_without_tensor_amax_message() -> None:
    """Two-level NVFP4 called without the tensor amax fails with the message that says so."""
    cfg = resolve("nvfp4")
    with pytest.raises(ValueError, match="^two-level NVFP4 needs the amax of the whole tensor$"):
        quantize_nvfp4(torch.ones(1, 16), cfg, None, None)


def test_nvfp4_scale_values_per_variant() -> None:
    """Block scales 2 and 3 with tensor scale 4: default multiplies (8, 12), compressed-tensors
    divides (0.5, 0.75), one_level ignores any tensor scale (2, 3), and no tensor scale means the
    block scales are the multipliers, whatever the variant."""
    s, ts = torch.tensor([2.0, 3.0]), torch.tensor(4.0)
    default, ct = resolve("nvfp4"), resolve("nvfp4", nvfp4_variant="compressed-tensors")
    one = resolve("nvfp4", nvfp4_variant="one_level")
    assert scale_values(s, ts, default).tolist() == [8.0, 12.0]
    assert scale_values(s, ts, ct).tolist() == [0.5, 0.75]
    assert scale_values(s, ts, one).tolist() == [2.0, 3.0]
    assert scale_values(s, None, default).tolist() == [2.0, 3.0]
    assert scale_values(s, None, ct).tolist() == [2.0, 3.0]
