"""Stochastic rounding's counter-based stream: Philox4x32-10 by element position.

The stream is checked against Random123's known-answer vectors and against a scalar Python
Philox written here; results must not depend on the path (C or torch), the thread count, the
chunking of the reference path, or the layout of the call.
"""

from __future__ import annotations

import pytest
import torch

from qtransform.formats import decode, encode, fake_quantize, fastpath, philox, quantize
from qtransform.formats.registry import get

M32 = 0xFFFFFFFF


def _philox_scalar(c: list[int], k0: int, k1: int) -> list[int]:
    """Philox4x32-10 on Python ints (Random123's definition), independent of philox.py."""
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & M32, (p0 >> 32) ^ c[3] ^ k1, p0 & M32]
    return c


def _u(seed: int, i: int) -> float:
    w = _philox_scalar([(i // 4) & M32, (i // 4) >> 32, 0, 0], seed & M32, seed >> 32)[i % 4]
    return (w >> 8) / 2.0**24


@pytest.mark.parametrize(("ctr", "key", "want"), [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, want):
    got = philox.philox4x32(tuple(torch.tensor([v]) for v in ctr), key)
    assert tuple(int(w) for w in got) == want
    assert tuple(_philox_scalar(list(ctr), *key)) == want


def test_uniform_is_the_documented_word_of_each_position():
    seed = 0xDEADBEEF_12345678
    pos = torch.tensor([0, 1, 2, 3, 4, 7, 2**33 + 5, 123456789])
    got = philox.uniform_at(seed, pos)
    assert got.tolist() == [_u(seed, int(i)) for i in pos]
    assert philox.positions((3, 4, 5), 1, 1, 2).tolist() == torch.arange(60).reshape(3, 4, 5)[:, 1:3].tolist()


def _grid_neighbours(a: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    grid = get(fmt).element.grid().double()
    idx = torch.searchsorted(grid, a.double(), right=True) - 1
    lo = grid[idx.clamp(0, grid.numel() - 1)]
    hi = grid[(idx + (grid[idx] != a.double()).long()).clamp(max=grid.numel() - 1)]
    return lo, hi


@pytest.mark.parametrize("fast", [True, False])
def test_formula_with_seed_and_generator(fast, monkeypatch):
    """out = copysign(floor(|x|/step + u) * step) with u of each element's position; the
    generator gives the seed from one draw of two 32-bit words, high word first."""
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "1" if fast else "0")
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 32, generator=g) * 8 - 4
    x[:, 0] = 4.0  # amax 4: E = 0 for E2M1, steps 0.5 / 1 / 2 at scale 1
    seed = 987654321987
    a = x.abs().double()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    u = torch.tensor([_u(seed, i) for i in range(x.numel())], dtype=torch.float64).reshape(x.shape)
    want = torch.copysign(torch.floor(a / step + u) * step, x.double()).float()
    assert torch.equal(fake_quantize(x, "mxfp4", rounding="stochastic", seed=seed), want)
    lo, hi = _grid_neighbours(x.abs(), "mxfp4")  # only the two neighbouring grid points
    assert ((want.abs().double() == lo) | (want.abs().double() == hi)).all()

    gen = torch.Generator().manual_seed(7)
    hi_w, lo_w = torch.randint(0, 2**32, (2,), generator=torch.Generator().manual_seed(7)).tolist()
    out = fake_quantize(x, "mxfp4", rounding="stochastic", generator=gen)
    assert torch.equal(out, fake_quantize(x, "mxfp4", rounding="stochastic", seed=(hi_w << 32) | lo_w))
    after = torch.Generator().manual_seed(7)
    torch.randint(0, 2**32, (2,), generator=after)
    assert torch.equal(gen.get_state(), after.get_state())  # exactly one draw
    with pytest.raises(ValueError, match="either seed= or generator="):
        fake_quantize(x, "mxfp4", rounding="stochastic", seed=1, generator=gen)


@pytest.mark.parametrize(("fmt", "opts"), [
    ("mxfp4", {}), ("mxfp4", {"axis": 0}), ("mxfp8_e4m3", {"block_shape": (32, 32)}),
    ("nvfp4", {}), ("nvfp4", {"nvfp4_variant": "compressed-tensors", "axis": 1}), ("int4", {}),
])
def test_same_result_with_1_and_2_threads_and_in_chunks(fmt, opts, monkeypatch):
    x = torch.randn(4, 130, 150, generator=torch.Generator().manual_seed(3))  # > MIN_PARALLEL
    x = x.to(torch.bfloat16) if fmt == "nvfp4" else x
    kw = {"rounding": "stochastic", "seed": 42, **opts}
    prev = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(fake_quantize(x, fmt, **kw))
    finally:
        torch.set_num_threads(prev)
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    runs.append(fake_quantize(x, fmt, **kw))  # reference: chunks of CHUNK_ELEMENTS
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 997)  # many small, uneven chunks
    runs.append(fake_quantize(x, fmt, **kw))
    runs.append(decode(encode(x, fmt, **kw)))  # one piece
    bits = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    if fastpath.library() is None:
        runs = runs[2:]
    for r in runs[1:]:
        assert torch.equal(r.view(bits), runs[0].view(bits))
    # a slice quantized alone uses its own positions: another draw, same distribution
    assert not torch.equal(fake_quantize(x[1:], fmt, **kw), runs[0][1:])
