"""FP8 element rounding by torch's float8 cast (nearest even) and by clearing mantissa bits
(toward zero) gives the generic grid rounding's bits on every kind of fp32 value: random bit
patterns, the grid, its midpoints, values a hair off either side, subnormals, NaN and infinity."""

from __future__ import annotations

import pytest
import torch

from qtransform.formats import elements
from qtransform.formats.registry import get


def values(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    grid = get(name).element.grid()
    bits = torch.randint(0, 0x7F800000, (400_000,), generator=g, dtype=torch.int64).to(torch.int32)
    nans = torch.tensor([0x7F800001, 0x7FC00000, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    return torch.cat([bits.view(torch.float32), nans, grid, (grid[1:] + grid[:-1]) / 2,
                      grid * (1 + 2**-20), grid * (1 - 2**-20),
                      torch.tensor([0.0, float("inf"), 1e30, 2.0**-130]),
                      torch.rand(100_000, generator=g) * 600, torch.rand(100_000, generator=g) * 2.0**-6])


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("rounding", ["rne", "rtz"])
def test_fp8_rounding_shortcuts_equal_the_generic_grid_rounding(name, rounding, monkeypatch):
    elem = get(name).element
    a = values(name)
    got = elements.round_magnitude(a, elem, rounding)
    monkeypatch.delitem(elements.FLOAT8_DTYPES, elem.name)  # the generic step-and-round path
    want = elements.round_magnitude(a, elem, rounding)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{int((~same).sum())} values differ"
    if rounding == "rtz":
        finite = torch.isfinite(a)
        assert bool((got[finite] <= a[finite]).all())  # never rounded up
