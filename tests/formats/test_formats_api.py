"""Public API of qtransform.formats: option validation, encoded form, block exponents."""

from __future__ import annotations

import pytest
import torch

import qtransform.formats as F
from qtransform.formats import (
    Encoded,
    block_exponents,
    decode,
    encode,
    fake_quantize,
    get,
    names,
    saturated,
)

ALL = [(f, {}) for f in names() if f != "nvfp4"] + [
    ("nvfp4", {"nvfp4_variant": v}) for v in ("default", "compressed-tensors", "one_level", "modelopt")]


def test_exports():
    for name in ("fake_quantize", "get", "names", "FormatSpec", "encode", "decode", "saturated",
                 "Encoded", "block_exponents"):
        assert hasattr(F, name), name


@pytest.mark.parametrize(("call", "message"), [
    (lambda x: fake_quantize(x, "mxfp5"), "did you mean 'mxfp4'"),
    (lambda x: fake_quantize(x, "bogus"), "registered formats: mxfp4"),
    (lambda x: fake_quantize(x, "nvfp4", scale_rule="rceil"), "MX formats only"),
    (lambda x: fake_quantize(x, "int8", scale_rule="even"), "MX formats only"),
    (lambda x: fake_quantize(x, "mxfp4", scale_rule="ceiling"), "allowed: floor, rceil, ceil"),
    (lambda x: fake_quantize(x, "mxfp4", rounding="nearest"), "allowed: rne, rna, rtz, stochastic"),
    (lambda x: fake_quantize(x, "mxfp4", rounding="rnee"), "did you mean 'rne'"),
    (lambda x: fake_quantize(x, "nvfp4", nvfp4_variant="torchao"), "default, compressed-tensors"),
    (lambda x: fake_quantize(x, "nvfp4", nvfp4_varient="default"), "did you mean 'nvfp4_variant'"),
    (lambda x: fake_quantize(x, "mxfp4", nvfp4_variant="default"), "applies to NVFP4 formats only"),
    (lambda x: fake_quantize(x, "mxfp4", block_sise=32), "unknown option 'block_sise' .did you mean 'block_size'"),
    (lambda x: fake_quantize(x, "mxfp4", scale_rul="floor"), "did you mean 'scale_rule'"),
    (lambda x: fake_quantize(x, "mxfp4", block_size=48), "allowed: 2, 4, 8"),
    (lambda x: fake_quantize(x, "mxfp4", block_size=32.0), "must be an int"),
    (lambda x: fake_quantize(x, "int4", block_size=0), "positive integer"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=32), "2-tuple"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=(32,)), "2-tuple"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=(32, 32, 1)), "2-tuple"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=(32, 24)), "not allowed"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=(32, 32), block_size=32), "not both"),
    (lambda x: fake_quantize(x, "mxfp4", block_shape=(32, 32), axis=0), "axis at -1"),
    (lambda x: fake_quantize(x[0], "mxfp4", block_shape=(32, 32)), ">= 2 dims"),
    (lambda x: fake_quantize(x, "mxfp4", axis=2), "out of range"),
    (lambda x: fake_quantize(x, "mxfp4", zero_saturated_grad="yes"), "True or False"),
    (lambda x: fake_quantize(x.int(), "mxfp4"), "floating-point"),
    (lambda x: block_exponents(x, "nvfp4"), "MX formats only"),
    (lambda x: encode(x, "int4", rounding="up"), "allowed: rne"),
    (lambda x: saturated(x, "nvfp4", scale_rule="even"), "MX formats only"),
])
def test_invalid_requests_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        call(torch.randn(4, 64))


def test_options_in_every_spelling():
    """A FormatSpec object, an explicit `block_shape=None`, an upper-case name and a list tile
    all take effect; the values are worked by hand (MXFP4: E = floor_log2(amax) - 2)."""
    x = torch.zeros(32, 2)
    x[0, 0], x[1, 0] = 6.0, 0.7  # rows 0-15 of column 0: amax 6, scale 1: 0.7 -> 0.5
    x[16, 0], x[17, 0] = 0.75, 0.1  # rows 16-31: amax 0.75, scale 2^-3: 0.1 / 0.125 = 0.8 -> 1
    want = torch.zeros(32, 2)
    want[0, 0], want[1, 0], want[16, 0], want[17, 0] = 6.0, 0.5, 0.75, 0.125
    out = fake_quantize(x, get("mxfp4"), block_size=16, block_shape=None, axis=0)
    assert torch.equal(out, want)
    # one block of 32 along axis 0 instead: amax 6, 0.75 is a tie that goes to 1.0, 0.1 -> 0
    assert fake_quantize(x, "mxfp4", axis=0)[[1, 16, 17], 0].tolist() == [0.5, 1.0, 0.0]
    t = torch.zeros(64, 64)
    t[0, 0], t[31, 31] = 6.0, 0.7  # one 32x32 tile: amax 6, 0.7 -> 0.5
    t[32, 32] = 0.7  # a tile of its own: scale 2^-3, 0.7 / 0.125 = 5.6 -> 6 -> 0.75
    t[0, 32] = 0.1  # alone: E = -4 - 2, 0.1 / 2^-6 = 6.4 -> 6 -> 0.09375
    want = torch.zeros(64, 64)
    want[0, 0], want[31, 31], want[32, 32], want[0, 32] = 6.0, 0.5, 0.75, 0.09375
    assert torch.equal(fake_quantize(t, "MXFP4", block_shape=[32, 32]), want)


@pytest.mark.parametrize(("fmt", "opts"), ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_decode_round_trip(fmt, opts, dtype):
    x = (torch.randn(3, 5, 45) * torch.logspace(-3, 3, 45)).to(dtype)
    x[0, 0, :3] = torch.tensor([-0.0, 0.0, -1e-30])
    for lay in ({}, {"axis": 0}, {"block_shape": get(fmt).tile if fmt != "int4" else (4, 8)}):
        enc = encode(x, fmt, **opts, **lay)
        assert isinstance(enc, Encoded) and enc.format == fmt and enc.dtype == dtype
        out = decode(enc)
        ref = fake_quantize(x, fmt, **opts, **lay)
        assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           ref.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert enc.codes.dtype == torch.uint8 and enc.codes.shape[0] == enc.scales.shape[0]
        assert int(enc.codes.max()) < 2 ** get(fmt).element.bits
        assert enc.scale_grid().shape == enc.layout.grid_shape


def test_encoded_scales_by_family():
    x = torch.randn(2, 64)
    mx = encode(x, "mxfp4")
    assert mx.scales.dtype == torch.uint8 and mx.tensor_scale is None
    assert torch.equal(mx.scales.to(torch.int32) - 127, block_exponents(x, "mxfp4").flatten())
    nv = encode(x, "nvfp4")
    assert nv.scales.dtype == torch.float32 and nv.tensor_scale.shape == ()
    # block scales are E4M3 values: a float8 round trip leaves them unchanged
    assert torch.equal(nv.scales.to(torch.float8_e4m3fn).float(), nv.scales)
    assert nv.tensor_scale.item() == pytest.approx(x.abs().max().item() / 2688, rel=1e-6)
    assert encode(x, "nvfp4", nvfp4_variant="one_level").tensor_scale is None
    ct = encode(x, "nvfp4", nvfp4_variant="compressed-tensors")
    assert ct.tensor_scale.item() == pytest.approx(2688 / x.abs().max().item(), rel=1e-6)
    it = encode(x, "int8")
    assert torch.allclose(it.scales, x.abs().amax(-1) / 127)


def test_element_codes():
    x = torch.zeros(32)
    x[:8] = torch.tensor([6.0, -6.0, 0.5, -0.5, 1.5, -0.0, 3.0, -4.0])  # E = 0
    assert encode(x, "mxfp4").codes[0, :8].tolist() == [7, 15, 1, 9, 3, 8, 5, 14]
    y = torch.zeros(32)
    y[:3] = torch.tensor([448.0, -2.0**-9, 1.0])  # E4M3 at E = 0
    assert encode(y, "mxfp8_e4m3").codes[0, :3].tolist() == [0x7E, 0x81, 0x38]
    z = torch.zeros(128)
    z[:4] = torch.tensor([127.0, -127.0, -0.0, -3.0])
    enc = encode(z, "int8")
    assert enc.codes[0, :4].tolist() == [127, 255, 128, 131]  # sign-magnitude keeps -0.0
    assert enc.signed_codes()[0, :4].tolist() == [127, -127, 0, -3]
    with pytest.raises(ValueError, match="integer elements"):
        encode(x, "mxfp4").signed_codes()


def test_block_exponents():
    x = torch.zeros(3, 70)
    x[0, :32] = 7.9999995
    x[1, 40] = float("nan")
    x[2, :] = 1.0
    e = block_exponents(x, "mxfp4")
    assert e.dtype == torch.int32 and e.shape == (3, 3)
    assert e.tolist() == [[0, -127, -127], [-127, 128, -127], [-2, -2, -2]]
    assert block_exponents(x, "mxfp4", scale_rule="rceil")[0, 0].item() == 1
    assert block_exponents(x.T, "mxfp4", axis=0).shape == (3, 3)
    assert block_exponents(x, "mxfp8_e4m3")[2, 0].item() == -8


def test_registry_element_bits():
    assert [get(n).element.bits for n in names()] == [4, 6, 6, 8, 8, 8, 4, 4, 8, 8, 8]


@pytest.mark.parametrize(("fmt", "opts", "numel", "bits"), [
    ("mxfp4", {}, None, 4 + 8 / 32),
    ("mxfp4", {"block_shape": [32, 32]}, 4096, 4 + 8 / 1024),
    ("mxfp8_e4m3", {"block_size": 64, "rounding": "rna"}, 64, 8 + 8 / 64),
    ("nvfp4", {}, None, 4 + 8 / 16),
    ("nvfp4", {}, 1024, 4 + 8 / 16 + 32 / 1024),  # E4M3 per 16, fp32 per tensor
    ("nvfp4", {"nvfp4_variant": "one_level"}, 1024, 4 + 8 / 16),  # no tensor scale
    ("int4", {}, 4096, 4 + 32 / 128),  # fp32 per group of 128, none per tensor
    ("int8", {"block_size": 24, "axis": 0}, 48, 8 + 32 / 24),
    ("fp8_e4m3", {}, None, 8 + 32 / 128),
    ("fp8_e4m3", {"granularity": "tensor"}, 4096, 8 + 32 / 4096),  # one fp32 scale per tensor
    ("int8", {"granularity": "channel"}, 4096, 8),  # one per row: its length is not known here
    ("fp8_e5m2", {"block_shape": [128, 128]}, None, 8 + 32 / 128**2),
])
def test_effective_bits_charge_each_scale_where_it_is_stored(fmt, opts, numel, bits):
    from qtransform.formats.expected import effective_bits

    assert effective_bits(fmt, opts, numel=numel) == pytest.approx(bits, abs=1e-12)
