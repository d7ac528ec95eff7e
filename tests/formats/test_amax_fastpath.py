"""The CPU kernel with an NVFP4 tensor-amax override (one value, or one per row: static and
per-token global scales) gives the reference path's bits."""

from __future__ import annotations

import pytest
import torch

from qtransform.formats import fastpath
from qtransform.formats import quantize as Q
from qtransform.formats.options import resolve

pytestmark = pytest.mark.skipif(fastpath.unavailable_reason() is not None,
                                reason=f"no CPU kernel: {fastpath.unavailable_reason()}")

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-10, 10, (*shape[:-1], 1), generator=g).float())
    x = torch.randn(shape, generator=g) * scale
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, 6.25, 7.5, -5.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", list(BITS))
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (4, 40), (2, 3, 1000), (64, 256)])
@pytest.mark.parametrize("variant", ["default", "compressed-tensors"])
def test_override_equals_the_reference(dtype, shape, variant, monkeypatch):
    x = data(shape, dtype)
    cfg = resolve("nvfp4", nvfp4_variant=variant)
    layout = Q.layout_for(x, cfg)
    for amax in (torch.tensor(3.25), torch.tensor(0.0), x.float().abs().amax(-1, keepdim=True)):
        fast = fastpath.quantize(x, cfg, layout, False, amax=amax)
        assert fast is not None  # the kernel took it
        monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
        ref = Q._forward(x, cfg, None, False, amax=amax)[0]
        monkeypatch.delenv("QTRANSFORM_FASTPATH")
        got = fast[0].reshape(x.shape)
        assert torch.equal(got.view(BITS[dtype]), ref.view(BITS[dtype])), amax.shape

