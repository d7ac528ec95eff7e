"""NVFP4 `scale_dtype`: compressed-tensors divides 2688/amax and amax/6 in a bf16/fp16 model's
dtype; `scale_dtype: "input"` reproduces it (checked against tests/llmc_reference.py's plain-torch
model of compressed-tensors, itself checked against llm-compressor in tests_llmc/)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qtransform
from tests.llmc_reference import global_scale, nvfp4

CT = {"nvfp4_variant": "compressed-tensors"}


def _tensor(seed: int, dtype: torch.dtype, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 64, generator=g) * torch.exp(torch.randn(6, 4, 1, generator=g) * spread
                                                     ).expand(6, 4, 16).reshape(6, 64)
    return x.to(dtype)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       spread=st.floats(0.0, 3.0))
def test_input_dtype_divisions_equal_compressed_tensors(seed, dtype, spread):
    x = _tensor(seed, dtype, spread)
    want = nvfp4(x, global_scale(x.abs().amax()))
    got = qtransform.fake_quantize(x, "nvfp4", **CT, scale_dtype="input")
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_given_amax_takes_the_same_divisions(dtype):
    """The static / fused global scale (`amax=`): a calibrated amax larger than x's own."""
    x = _tensor(3, dtype, 2.0)
    a = (x.abs().amax() * 3).to(dtype)
    want = nvfp4(x, global_scale(a))
    got = qtransform.fake_quantize(x, "nvfp4", **CT, scale_dtype="input", amax=a.float())
    assert torch.equal(got, want)


def test_the_fp32_divisions_differ_on_bf16_and_the_option_is_neutral_on_fp32():
    """The control: fp32 divisions miss compressed-tensors on bf16; on fp32 "input" is float32."""
    x = _tensor(5, torch.bfloat16, 2.0)
    want = nvfp4(x, global_scale(x.abs().amax()))
    assert not torch.equal(qtransform.fake_quantize(x, "nvfp4", **CT), want)
    x32 = _tensor(5, torch.float32, 2.0)
    assert torch.equal(qtransform.fake_quantize(x32, "nvfp4", **CT, scale_dtype="input"),
                       qtransform.fake_quantize(x32, "nvfp4", **CT))
    assert torch.equal(qtransform.fake_quantize(x32, "nvfp4", **CT, scale_dtype="input"),
                       nvfp4(x32, global_scale(x32.abs().amax())))


def test_zero_tensor_keeps_global_scale_one():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    assert torch.equal(qtransform.fake_quantize(x, "nvfp4", **CT, scale_dtype="input"), x)


@pytest.mark.parametrize("variant", ["default", "modelopt", "one_level"])
def test_other_variants_refuse_a_scale_dtype(variant):
    with pytest.raises(ValueError, match="applies to nvfp4_variant 'compressed-tensors' only"):
        qtransform.fake_quantize(torch.ones(16), "nvfp4", nvfp4_variant=variant, scale_dtype="input")
