"""`fake_quantize(scale=)`: a tensor-level scale as a checkpoint stores it, used as it is.

Where the stored scale is the one an amax gives, the two calls agree bit for bit; where no amax
gives it (a bf16-rounded NVFP4 global scale, as llm-compressor stores it for a bf16 model), the
stored scale is what counts, and an amax reconstructed from it computes something else."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform import fake_quantize
from qtransform.formats import QuantConfig

CT_NVFP4 = {"nvfp4_variant": "compressed-tensors", "scale_dtype": "input"}


def rows(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(6, 64, generator=g) * torch.rand(6, 1, generator=g) * 8).to(dtype)


def tensor_scale(x: torch.Tensor, fmt: str, opts: dict, amax: torch.Tensor) -> torch.Tensor:
    """The stored tensor-level scale the format computes from `amax` (what a writer stores)."""
    from qtransform.formats.quantize import quantize_blocks

    cfg = QuantConfig.from_options(fmt, opts).bind(-1)
    res, _ = quantize_blocks(x[:1], cfg, amax_t=amax)
    return res.tensor_scale if res.tensor_scale is not None else res.scales[0]


CASES = [("nvfp4", CT_NVFP4), ("nvfp4", {"nvfp4_variant": "compressed-tensors"}),
         ("nvfp4", {"nvfp4_variant": "modelopt"}),
         ("fp8_e4m3", {"granularity": "tensor", "scale_dtype": "input"}),
         ("int8", {"granularity": "tensor", "int_range": "full"})]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(CASES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       amax=st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False))
def test_the_stored_scale_of_an_amax_quantizes_as_that_amax(seed, case, dtype, amax):
    fmt, opts = case
    x = rows(seed, dtype)
    a = torch.tensor(amax, dtype=dtype).to(torch.float32)  # an amax of a tensor of that dtype
    stored = tensor_scale(x, fmt, opts, a)
    assert torch.equal(fake_quantize(x, fmt, scale=stored, **opts), fake_quantize(x, fmt, amax=a, **opts))


def test_a_bf16_rounded_global_scale_is_used_as_stored():
    """g = 2144 (bf16 of 2688 / 1.2578125): the amax 2688 / g gives the bf16 model g = 2160."""
    x = rows(0, torch.bfloat16) * 0.2
    g = torch.tensor(2144.0)
    got = fake_quantize(x, "nvfp4", scale=g, **CT_NVFP4)
    reconstructed = fake_quantize(x, "nvfp4", amax=torch.tensor(2688.0) / g, **CT_NVFP4)
    # by hand: compressed-tensors' forward with its stored fp32 global scale g
    blocks = x.reshape(6, 4, 16).float()
    sixth = (blocks.abs().amax(-1).to(torch.bfloat16) / 6).float()
    s = (g * sixth).clamp(max=448).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, 0.125, s)
    scale = (s / g)[..., None]
    y = (blocks / scale).clamp(-6, 6)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    distance = (y.abs()[..., None] - grid).abs()
    assert ((distance == distance.amin(-1, keepdim=True)).sum(-1) == 1).all()  # no ties here
    mag = grid[distance.argmin(-1)]
    want = (torch.copysign(mag, y) * scale).reshape(6, 64).to(torch.bfloat16)
    assert torch.equal(got, want)
    assert not torch.equal(reconstructed, got)


@pytest.mark.parametrize(("fmt", "opts", "message"), [
    ("mxfp4", {}, "has none of"),
    ("fp8_e4m3", {"granularity": "channel"}, "has none of"),
    ("nvfp4", {"nvfp4_variant": "one_level"}, "has none of"),
    ("nvfp4", {}, "takes nvfp4_variant 'compressed-tensors'"),
])
def test_scale_needs_a_tensor_level_scale(fmt, opts, message):
    with pytest.raises(ValueError, match=message):
        fake_quantize(torch.ones(2, 32), fmt, scale=torch.tensor(1.0), **opts)


def test_scale_and_amax_do_not_go_together():
    with pytest.raises(ValueError, match="amax= or scale=, not both"):
        fake_quantize(torch.ones(2, 32), "nvfp4", scale=torch.tensor(1.0), amax=torch.tensor(1.0))
    with pytest.raises(ValueError, match="one-element"):
        fake_quantize(torch.ones(2, 32), "nvfp4", scale=torch.ones(2))
