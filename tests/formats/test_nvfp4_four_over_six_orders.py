"""`four_over_six_order`: each stack's four-over-six choice, bit for bit against an independent
port of the stack's fp32 computation (tests/formats/stack_fouroversix.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.export.functions import UnsupportedExport
from qtransform.formats import fake_quantize, registry
from qtransform.formats.nvfp4 import quantize_nvfp4
from qtransform.formats.options import QuantConfig
from tests.formats import stack_fouroversix as port

ORDERS = ("pairwise", "transformer-engine", "flashinfer", "fouroversix")

# Blocks on near-ties (element 0 is the block amax), found by bisecting one element across the
# pairwise order's decision boundary at global_bound 256, with the tensor amax beside them and
# whether each order (ORDERS) keeps max/4: together they separate every pair of orders.
SEPARATING = [
    ("mse", 1.0, (1, 0, 0, 0), [1065353216, 1056168001, 1064770222, 3210933496, 3211142646, 1064987329,
                                1053937648, 3209560679, 1051076272, 1050029242, 1052678167, 1059635144,
                                1055659319, 1037390167, 3195927976, 1058929909]),
    ("mse", 1.3, (0, 0, 1, 0), [1065353216, 1049054830, 1058987080, 3198288016, 1035132562, 3206250234,
                                1065223736, 3204675907, 3203987388, 3210381013, 3209815311, 1057405128,
                                1053467805, 3208519307, 3195893419, 3189896183]),
    ("mse", 1.3, (0, 0, 0, 1), [1065353216, 1051655808, 3194614877, 1057066760, 3206342634, 3209347967,
                                3211535653, 3206862205, 1050789792, 1051660266, 1051823837, 1042908987,
                                1063398863, 3181674743, 3208698756, 3204448449]),
    ("mae", 1.3, (1, 0, 0, 0), [1065353216, 3205064594, 1063879021, 3206293600, 3200007031, 1058728929,
                                1025680936, 1062736796, 1058019481, 3208845038, 3205589662, 3194425204,
                                1061358771, 3198811898, 3180803914, 3172831669]),
    ("mae", 1.3, (0, 0, 1, 0), [1065353216, 1060287991, 1045983336, 1058844854, 1048932869, 3196885298,
                                1057326620, 3211948190, 3185171114, 3196270734, 3207381373, 3208554624,
                                3205370772, 1040067023, 3194345806, 1058362358]),
    ("mae", 5.0, (0, 0, 0, 1), [1065353216, 3194849619, 1064931750, 3191900405, 3201105192, 1059108663,
                                3179835462, 3202890204, 3201999385, 3208893132, 1064069314, 1050001184,
                                3202517670, 1054372128, 3205563287, 3199610735]),
]


def cfg(mode: str, order: str, bound: int) -> QuantConfig:
    return QuantConfig.from_options(registry.get("nvfp4"), {
        "four_over_six": mode, "four_over_six_order": order, "global_bound": bound})


def chosen(blocks: torch.Tensor, amax: float, mode: str, order: str, bound: int) -> torch.Tensor:
    """The E4M3 block scales the order keeps."""
    return quantize_nvfp4(blocks, cfg(mode, order, bound), None, torch.tensor(amax, dtype=torch.float32)).scales


def ported(blocks: torch.Tensor, amax: float, mode: str, order: str, bound: int) -> torch.Tensor:
    """The same from the stack's port."""
    a = np.float32(amax)
    rows = blocks.numpy()
    if order == "transformer-engine":
        return torch.tensor([port.transformer_engine(r, a, bound, mode)[1] for r in rows])
    if order == "flashinfer":
        g = np.float32(min(np.float32(6 * bound) / a, port.FLT_MAX))
        return torch.tensor([port.flashinfer(r, g, mode)[1] for r in rows])
    assert order == "fouroversix" and bound == 256
    return torch.from_numpy(port.fouroversix(rows, a, mode)[1])


def six_scale(blocks: torch.Tensor, amax: float, order: str, bound: int) -> torch.Tensor:
    """The order's max/6 scale: (amax_b / 6) * g for the stacks, amax_b * (g * fl(1/6)) pairwise."""
    g = np.float32(6 * bound) / np.float32(amax)
    amax_b = blocks.abs().amax(dim=1).numpy()
    if order == "pairwise":
        base = amax_b * (g * np.float32(1 / 6))
    else:
        base = (amax_b / np.float32(6)) * g
    return torch.tensor([port.e4m3(np.float32(b)) for b in base])


@pytest.mark.parametrize(("mode", "amax", "keeps", "bits"), SEPARATING)
def test_each_order_equals_its_stack_on_separating_near_ties(mode, amax, keeps, bits):
    block = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32)).reshape(1, 16)
    got = []
    for order in ORDERS:
        s = chosen(block, amax, mode, order, 256)
        if order != "pairwise":
            assert torch.equal(s, ported(block, amax, mode, order, 256)), order
        got.append(int(not torch.equal(s, six_scale(block, amax, order, 256))))
    assert tuple(got) == keeps  # the orders do decide this block differently


def test_the_separating_blocks_separate_every_pair_of_orders():
    for i in range(len(ORDERS)):
        for j in range(i + 1, len(ORDERS)):
            assert any(k[i] != k[j] for _, _, k, _ in SEPARATING), (ORDERS[i], ORDERS[j])


@pytest.mark.parametrize("order", ORDERS[1:])
def test_a_tie_keeps_max6(order):
    """Every element exactly at the block amax: both candidates are exact (error 0 twice)."""
    block = torch.full((1, 16), 1.0)
    for mode in ("mse", "mae"):
        s = chosen(block, 1.0, mode, order, 256)
        assert s.item() == 256.0  # max/6, not the max/4 scale 384
        assert torch.equal(s, ported(block, 1.0, mode, order, 256))


@pytest.mark.parametrize("order", ("transformer-engine", "flashinfer"))
def test_a_max4_scale_saturating_at_448_keeps_max6(order):
    """At bound 448 the block holding the tensor amax has s4 = e4m3(672), saturated to 448 = s6."""
    block = torch.tensor([[1.0, 0.9, 0.7, 0.66] * 4])
    for mode in ("mse", "mae"):
        s = chosen(block, 1.0, mode, order, 448)
        assert s.item() == 448.0
        assert torch.equal(s, ported(block, 1.0, mode, order, 448))


blocks_st = st.lists(st.floats(-4.0, 4.0, width=32, allow_subnormal=False), min_size=64, max_size=64)


@settings(max_examples=40, deadline=None)
@given(values=blocks_st, factor=st.sampled_from([1.0, 1.5, 7.0, 300.0]),
       mode=st.sampled_from(["mse", "mae"]), bound=st.sampled_from([448, 256]))
def test_each_order_equals_its_stack_on_random_blocks(values, factor, mode, bound):
    blocks = torch.tensor(values, dtype=torch.float32).reshape(4, 16)
    amax = float(np.float32(float(blocks.abs().max()) * factor)) or 1.0
    for order in ORDERS[1:] if bound == 256 else ORDERS[1:3]:
        assert torch.equal(chosen(blocks, amax, mode, order, bound),
                           ported(blocks, amax, mode, order, bound)), order


def test_fake_quantize_takes_the_order_on_the_cpu_fast_path_too():
    """The C kernel runs pairwise only; the other orders reach the reference path."""
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    amax = x.abs().amax()
    for order in ORDERS:
        c = cfg("mse", order, 256)
        res = quantize_nvfp4(x.reshape(-1, 16), c, None, amax)
        got = fake_quantize(x, "nvfp4", four_over_six="mse", four_over_six_order=order, global_bound=256)
        assert torch.equal(got, res.out.reshape(32, 64)), order


def test_refusals():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="set four_over_six 'mse' or 'mae'"):
        fake_quantize(x, "nvfp4", four_over_six_order="flashinfer")
    with pytest.raises(ValueError, match="set global_bound 256"):
        fake_quantize(x, "nvfp4", four_over_six="mse", four_over_six_order="fouroversix")
    with pytest.raises(ValueError, match="rounds to nearest even"):
        fake_quantize(x, "nvfp4", four_over_six="mse", four_over_six_order="flashinfer", rounding="rna")
    from qtransform.export.families.nvfp4 import nvfp4_blocks
    with pytest.raises(UnsupportedExport, match="four_over_six_order 'transformer-engine' has no ONNX form"):
        nvfp4_blocks(None, "x", "axes", cfg("mae", "transformer-engine", 448), amax_t="a")
