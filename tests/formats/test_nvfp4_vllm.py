"""`nvfp4_variant` "vllm": vLLM's NVFP4 activation quantizer on CUDA (`scaled_fp4_quant`, and
FlashInfer's `nvfp4_quantize` where vLLM calls it), against a scalar port of TensorRT-LLM's
`cvt_warp_fp16_to_fp4` written from its steps (the global scale g given, as vLLM passes the
checkpoint's input_global_scale): SF = e4m3(g · (vecMax · fl(1/6))), outputScale =
1 / (SF · fl(1/g)), q = e2m1(x · outputScale), decoded (q · SF) · fl(1/g); with `four_over_six`,
FlashInfer's choice (`FLASHINFER_NVFP4_4OVER6`) against the port of its per-tensor path in
tests/formats/stack_fouroversix.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize
from tests.export.test_onnx_functions import check
from tests.formats import stack_fouroversix as stacks

F32 = np.float32


def port_block(block: np.ndarray, g: np.float32) -> np.ndarray:
    """One 16-value block, each step one fp32 operation in the kernel's order."""
    gds = F32(1) / g
    vmax = F32(np.abs(block).max())
    sf = stacks.e4m3(min(g * (vmax * (F32(1) / F32(6))), F32(448)))
    enc = F32(1) / (sf * gds) if sf != 0 else F32(0)
    return np.array([(stacks.e2m1_rne(v * enc) * sf) * gds for v in block], dtype=F32)


def rows(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
    x[0, :16] = 0.0
    return x.bfloat16().float()  # activations arrive in 16 bits


def port(x: torch.Tensor, g: float) -> torch.Tensor:
    blocks = x.numpy().reshape(-1, 16)
    return torch.from_numpy(np.stack([port_block(b, F32(g)) for b in blocks]).reshape(x.shape))


@pytest.mark.parametrize("g", [None, 1234.5677, 3.0e-3])
def test_equals_the_kernel_steps(g):
    x = rows(64, seed=1)
    g_used = F32(2688) / F32(x.abs().max()) if g is None else F32(g)
    got = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", **({} if g is None else {"scale": torch.tensor(g)}))
    assert torch.equal(got, port(x, g_used))


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.integers(0, 2**16 - 1), min_size=16, max_size=64),
       g=st.floats(2.0**-10, 2.0**20, width=32))
def test_bf16_bit_patterns(words, g):
    n = len(words) // 16 * 16
    x = torch.tensor(words[:n], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().reshape(-1, 16)
    x = torch.where(x.isfinite(), x, 0.0)
    got = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", scale=torch.tensor(g))
    assert torch.equal(got, port(x, F32(g)))


def test_separates_from_the_producers_orders():
    """The engine's association g · (amax_b · fl(1/6)) and its reciprocal encode are neither
    NVIDIA's default order nor compressed-tensors' x / (s / g): blocks land apart."""
    x = rows(512, seed=3)
    g = torch.tensor(F32(2688) / F32(x.abs().max()))
    ours = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", scale=g)
    ct = fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors", scale=g)
    default = fake_quantize(x, "nvfp4")
    assert (ours != ct).sum() > 10 and (ours != default).sum() > 10


@pytest.mark.parametrize("mode", ["mae", "mse"])
def test_four_over_six_is_flashinfers_choice_under_the_stored_scale(mode):
    x = rows(256, seed=4)
    g = F32(777.125)
    got = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", four_over_six=mode, scale=torch.tensor(g))
    want = []
    for block in x.numpy().reshape(-1, 16):
        _, s = stacks.flashinfer(block, g, mode)
        gds = F32(1) / g
        enc = min(F32(1) / (F32(s) * gds), stacks.FLT_MAX) if s else stacks.FLT_MAX
        want.append([(stacks.e2m1_rne(v * enc) * F32(s)) * gds for v in block])
    assert torch.equal(got, torch.tensor(np.array(want, dtype=F32)).reshape(x.shape))
    plain = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", scale=torch.tensor(g))
    assert (got != plain).reshape(-1, 16).any(dim=1).sum() > 5


def test_onnx_is_bit_exact_without_four_over_six():
    x = rows(32, seed=2)
    check([("nvfp4", {"nvfp4_variant": "vllm"})], x, static=False)
    check([("nvfp4", {"nvfp4_variant": "vllm"})], x, static=True)


@pytest.mark.parametrize(("opts", "words"), [
    ({"four_over_six": "mae", "four_over_six_order": "transformer-engine"}, "FlashInfer's order"),
    ({"global_bound": 256}, "remove global_bound"),
    ({"four_over_six": "mse", "rounding": "rna"}, "nearest even"),
])
def test_refusals_are_one_line(opts, words):
    with pytest.raises(ValueError, match=words) as exc:
        fake_quantize(torch.ones(2, 16), "nvfp4", nvfp4_variant="vllm", **opts)
    assert "\n" not in str(exc.value)
