"""`four_over_six_order: "modelopt"`: ModelOpt's NVFP4_FOUR_OVER_SIX_CFG weights (its MSE
calibration's choice of block amax, then its export's arithmetic), bit for bit against an
independent numpy port (tests/formats/stack_fouroversix.py) on blocks that separate its rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import registry
from qtransform.formats.nvfp4 import quantize_nvfp4
from qtransform.formats.options import QuantConfig
from tests.formats import stack_fouroversix as port

F32 = np.float32
OPTIONS = {"nvfp4_variant": "modelopt", "four_over_six": "mse", "four_over_six_order": "modelopt",
           "global_bound": 256}
CFG = QuantConfig.from_options(registry.get("nvfp4"), OPTIONS)
ON_FOUR_GRID = [1.0, 0.75, -0.5, 0.375, 0.25, -0.125, 0.75, 0.5, -0.375, 0.25, 0.125, 0.0, -0.75, 0.5,
                0.375, -0.25]  # times the amax: every value is on the max/4 grid, not all on max/6


def quantized(blocks: np.ndarray, g_amax: float):
    return quantize_nvfp4(torch.from_numpy(blocks), CFG, None, torch.tensor(g_amax, dtype=torch.float32))


def assert_as_ported(blocks: np.ndarray, g_amax: float) -> list[bool]:
    """The format's elements, block scales and tensor scale equal the port's; which blocks took 1.5."""
    res = quantized(blocks, g_amax)
    fours = []
    for i, b in enumerate(blocks):
        four, values, s, d = port.modelopt_four_over_six(b, F32(g_amax))
        assert res.scales[i].item() == s, (i, res.scales[i].item(), s)
        assert torch.equal(res.q[i], torch.tensor(values, dtype=torch.float32)), i
        want_out = torch.tensor(values, dtype=torch.float32) * torch.tensor(F32(F32(s) * d))
        assert torch.equal(res.out[i], want_out + 0.0), i  # served: q * (s * d), zeros +0
        assert res.tensor_scale is not None and res.tensor_scale.item() == float(d)
        fours.append(four)
    return fours


def test_a_block_on_the_max4_grid_takes_1_5_and_its_scale_is_normalized_to_256():
    a = 3.0
    blocks = np.array([[v * a for v in ON_FOUR_GRID]], dtype=F32)
    assert assert_as_ported(blocks, a) == [True]
    # 1.5 * amax through the export: (a * 1.5 / 6) * 256 / (G / 6) = 384, where max/6 would store 256
    assert quantized(blocks, a).scales.tolist() == [384.0]


def test_a_tie_keeps_1_0():
    """[6, 0, ...] with G = 6: both candidates reproduce the block exactly (losses 0 and 0), the
    argmin keeps the first multiplier: the stored scale is max/6's 256, not 384."""
    blocks = np.zeros((1, 16), dtype=F32)
    blocks[0, 0] = 6.0
    assert port.modelopt_fake_quant(blocks[0], F32(6), F32(6)) == port.modelopt_fake_quant(blocks[0], F32(9), F32(6))
    assert assert_as_ported(blocks, 6.0) == [False]
    assert quantized(blocks, 6.0).scales.tolist() == [256.0]


def test_the_clamps_at_2_to_the_minus_9_and_448():
    """A block whose amax is G * 2^-18: calibration's max/6 scale rounds to E4M3 zero (2^-10, a
    tie to even) and its max/4 scale to 2^-9, so 1.5 wins; the export clamps 384 * 2^-18 up to
    2^-9. A zero block: amax / 6 taken as 1, 1 * 256 / (G / 6) = 1536 clamped to 448. A block at
    G * 2^-21: both candidates' fake-quantized scales are 0 (a tie: 1.0), yet the export clamps its
    scale up to 2^-9 and stores nonzero elements (the fake-quantized model holds zeros there)."""
    g = 1.0
    blocks = np.zeros((3, 16), dtype=F32)
    blocks[0] = [v * 2.0**-18 for v in ON_FOUR_GRID]
    blocks[2] = [v * 2.0**-21 for v in ON_FOUR_GRID]
    assert assert_as_ported(blocks, g) == [True, False, False]
    res = quantized(blocks, g)
    assert res.scales.tolist() == [2.0**-9, 448.0, 2.0**-9]
    assert all(v == 0 for v in port.modelopt_fake_quant(blocks[2], F32(2.0**-21), F32(g)))
    assert bool((res.out[2] != 0).any())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=64, max_size=64),
       st.floats(1.0, 4.0, width=32))
def test_any_blocks_equal_the_port(values, spread):
    blocks = np.array(values, dtype=F32).reshape(4, 16)
    assert_as_ported(blocks, float(F32(np.abs(blocks).max() * F32(spread))) or 1.0)


@pytest.mark.parametrize(("change", "message"), [
    ({"four_over_six": "mae"}, "squared error"),
    ({"global_bound": 448}, "global_bound 256"),
    ({"nvfp4_variant": "default"}, "nvfp4_variant 'modelopt'"),
    ({"four_over_six_order": "pairwise"}, "four_over_six_order 'modelopt'"),
])
def test_the_option_set_is_refused_apart_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        QuantConfig.from_options(registry.get("nvfp4"), {**OPTIONS, **change})


def test_a_stored_tensor_scale_is_refused():
    with pytest.raises(ValueError, match="tensor amax"):
        quantize_nvfp4(torch.ones(1, 16), CFG, None, None, scale_t=torch.tensor(1.0))
