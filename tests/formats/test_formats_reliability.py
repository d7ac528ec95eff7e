"""Failure modes of the formats layer: a damaged kernel cache, NaN bits in half-precision
outputs, huge block sizes, the reference path's memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from qtransform.errors import UserError
from qtransform.formats import decode, encode, fake_quantize, fastpath, quantize
from tests.formats.test_formats_options import exactly

HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None

_CHILD = """
import torch
from qtransform.formats import fake_quantize, fastpath
x = torch.linspace(-5, 5, 4096).reshape(64, 64)
out = fake_quantize(x, "nvfp4")
print(fastpath.library() is not None, out.view(torch.int32).sum().item(), out.abs().sum().item())
"""


def test_truncated_cached_library_is_rebuilt(tmp_path, monkeypatch):
    if not HAS_CC:
        pytest.skip("fast path not testable here: no C compiler on PATH")
    monkeypatch.setenv("QTRANSFORM_CACHE_DIR", str(tmp_path))
    lib = fastpath.build()
    assert lib is not None and fastpath.verified(lib)
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 3])  # what a full disk or a killed copy leaves
    assert not fastpath.verified(lib)
    env = {**os.environ, "QTRANSFORM_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr  # a SIGBUS would be -7
    x = torch.linspace(-5, 5, 4096).reshape(64, 64)
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    want = fake_quantize(x, "nvfp4")
    assert res.stdout.split() == ["True", str(want.view(torch.int32).sum().item()),
                                  str(want.abs().sum().item())]
    assert fastpath.verified(lib) and lib.read_bytes() != data[: len(data) // 3]


@pytest.mark.parametrize("path", ["fast", "reference"])
@pytest.mark.parametrize(("dtype", "nan_bits"), [(torch.bfloat16, 0x7FC0), (torch.float16, 0x7E00)])
def test_half_precision_nan_bits_are_canonical(path, dtype, nan_bits, monkeypatch):
    """Every NaN output is +qNaN of its dtype, whatever the input NaN's sign and payload, on
    both paths, for small (scalar narrowing in torch) and large tensors."""
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "1" if path == "fast" else "0")
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    bits = x.view(torch.int16)
    neg_nan = 0xFFC1 if dtype == torch.bfloat16 else 0xFE01
    bits[0, 5], bits[7, 33], bits[9, 2] = neg_nan - 0x10000, nan_bits + 3, neg_nan - 0x10000
    x[11, 40] = float("inf")
    for fmt, opts in (("mxfp4", {}), ("nvfp4", {"nvfp4_variant": "one_level"}), ("int8", {}),
                      ("mxfp8_e4m3", {"rounding": "stochastic", "seed": 1})):
        for t in (x, x[0, 5], x[:2]):
            out = fake_quantize(t, fmt, **opts).view(torch.int16).reshape(-1) & 0xFFFF
            nan = torch.isnan(fake_quantize(t, fmt, **opts).reshape(-1))
            assert nan.any() and (out[nan] == nan_bits).all(), (fmt, t.shape)
    assert (decode(encode(x, "mxfp4")).view(torch.int16)[0, :32] & 0xFFFF == nan_bits).all()


def test_a_block_longer_than_its_axis_is_an_error_naming_the_axis():
    """A group longer than the row used to become one group per row silently (an int8 scan with
    a block of 2^33 exited 0 as per-row): now it is one line naming the axis length and the fix.
    The format's own default block on a short axis (int4's 128 on a 100-wide row) still covers
    the whole row, and so does granularity 'token' on purpose."""
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    for fmt in ("int4", "int8"):
        with pytest.raises(UserError, match=exactly(
                f"{fmt}: block_size 8589934592 is longer than axis 1 of a tensor of shape "
                "[4, 100] (100 elements); use a block of at most 100, or granularity 'channel' "
                "(weights) / 'token' (activations) for one scale per whole row")):
            fake_quantize(x, fmt, block_size=2**33)
        with pytest.raises(UserError, match="block_shape 1000000000x4 is longer than axis 0 "):
            fake_quantize(x, fmt, block_shape=(10**9, 4))
        with pytest.raises(UserError, match=r"longer than axis 0 .* \(4 elements\)"):
            encode(x, fmt, block_size=8, axis=0)
        whole = fake_quantize(x, fmt, block_size=100)
        assert torch.equal(fake_quantize(x, fmt), whole)  # the default 128 covers the row
        assert torch.equal(fake_quantize(x, fmt, granularity="token"), whole)
    x1 = torch.randn(20)  # shorter than an MX block: one block of 20
    assert torch.equal(fake_quantize(x1, "mxfp4"), fake_quantize(torch.cat([x1, torch.zeros(12)]), "mxfp4")[:20])


def test_reference_path_chunks_do_not_change_results(monkeypatch):
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")
    x = torch.randn(3, 70, 90, generator=torch.Generator().manual_seed(2))
    cases = [("nvfp4", {}), ("mxfp4", {"axis": 1}), ("int4", {"block_size": 32, "axis": 1}),
             ("mxfp8_e5m2", {"block_shape": (32, 32)})]
    whole = [fake_quantize(x, f, **o) for f, o in cases]
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 500)
    for (f, o), w in zip(cases, whole, strict=True):
        assert torch.equal(fake_quantize(x, f, **o).view(torch.int32), w.view(torch.int32)), (f, o)
