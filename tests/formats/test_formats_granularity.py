"""Granularity (block, channel, token, tensor, tile), the FP8 family, the integer conventions,
the scale dtype and the `amax=` override: properties (hypothesis) and the errors users see."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.errors import UserError
from qtransform.formats import encode, fake_quantize, get
from qtransform.formats.options import resolve
from qtransform.formats.quantize import quantize_with_info, saturated
from tests.formats.test_formats_options import exactly
from tests.formats.test_formats_properties import same_or_both_nan, tensors

SETTINGS = settings(max_examples=50, deadline=None)
SCALED = ["fp8_e4m3", "fp8_e5m2", "int4", "int8"]
ROWWISE = [{"granularity": "channel"}, {"granularity": "token"}, {"block_size": 16},
           {"block_size": 5}]
scaled_configs = st.tuples(
    st.sampled_from(SCALED),
    st.fixed_dictionaries({"rounding": st.sampled_from(["rne", "rna"]),
                           "granularity": st.sampled_from(["channel", "token", "tensor"])}))


def _opts(fmt: str, opts: dict, int_range: str) -> dict:
    return {**opts, "int_range": int_range} if fmt.startswith("int") else opts


@SETTINGS
@given(x=tensors(lo=-20, hi=20), fmt=st.sampled_from(SCALED), opts=st.sampled_from(ROWWISE),
       int_range=st.sampled_from(["restricted", "full"]))
def test_a_row_alone_equals_the_row_in_its_batch(x, fmt, opts, int_range):
    """Per channel, per token and per group the scale of a row depends on that row only, so a
    sequence's tokens quantize the same whatever else is in the batch."""
    opts = _opts(fmt, opts, int_range)
    if opts.get("block_size", 0) > x.shape[-1]:
        return
    batch = fake_quantize(x, fmt, **opts)
    for i in range(x.shape[0]):
        assert same_or_both_nan(fake_quantize(x[i:i + 1], fmt, **opts), batch[i:i + 1])


@SETTINGS
@given(x=tensors(lo=-20, hi=20), cfg=scaled_configs)
def test_sign_symmetric(x, cfg):
    """-q(x) == q(-x) bit for bit, signed zeros included (the full integer range, [-8, 7], is
    not symmetric: `test_int_ranges`)."""
    fmt, opts = cfg
    assert same_or_both_nan(fake_quantize(-x, fmt, **opts), -fake_quantize(x, fmt, **opts))


@SETTINGS
@given(x=tensors(lo=-20, hi=20), cfg=scaled_configs)
def test_idempotent_to_a_few_ulps(x, cfg):
    """Quantizing the output again gives it back: its amax is qmax * scale, so the recomputed
    scale is the same to an ULP (fp32 subnormal scales aside)."""
    fmt, opts = cfg
    q = fake_quantize(x, fmt, **opts)
    qq = fake_quantize(q, fmt, **opts)
    if q.abs().max() < 2.0**-100:
        return
    assert torch.allclose(qq, q, rtol=3e-7, atol=0.0, equal_nan=True)


@SETTINGS
@given(x=tensors(lo=-20, hi=20), fmt=st.sampled_from(SCALED), k=st.integers(-20, 20),
       g=st.sampled_from(["channel", "tensor", "block"]))
def test_power_of_two_equivariance(x, fmt, k, g):
    opts = {"granularity": g} if g != "block" else {"block_size": 4}
    if opts.get("block_size", 0) > x.shape[-1]:
        return
    a = fake_quantize(x * 2.0**k, fmt, **opts)
    assert same_or_both_nan(a, fake_quantize(x, fmt, **opts) * 2.0**k)


def test_whole_row_granularities_are_a_block_of_the_row():
    x = torch.randn(6, 40) * torch.logspace(-3, 3, 6)[:, None]
    for fmt in SCALED:
        row = fake_quantize(x, fmt, block_size=40)
        assert torch.equal(fake_quantize(x, fmt, granularity="channel"), row)
        assert torch.equal(fake_quantize(x, fmt, granularity="token"), row)
        assert torch.equal(fake_quantize(x, fmt, granularity="channel", axis=0),
                           fake_quantize(x, fmt, block_size=6, axis=0))
        whole = fake_quantize(x.reshape(1, -1), fmt, block_size=240).reshape(6, 40)
        assert torch.equal(fake_quantize(x, fmt, granularity="tensor"), whole)


def test_fp8_values_are_the_float8_cast_of_x_over_amax_scale():
    """An independent reference: torch's own float8 casts after the fp32 division."""
    x = torch.randn(8, 64) * torch.logspace(-4, 4, 64)
    x[2] = 0.0
    for fmt, dtype, top in (("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)):
        scale = x.abs().amax(dim=1, keepdim=True) / top
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        want = (x / scale).clamp(-top, top).to(dtype).to(torch.float32) * scale
        assert torch.equal(fake_quantize(x, fmt, granularity="token"), want)


def test_int_ranges():
    """restricted: amax / qmax, codes +-qmax; full (compressed-tensors): amax / (qmax + 0.5),
    codes in [-qmax - 1, qmax], so the negative amax may round to -(qmax + 1) * scale."""
    x = torch.tensor([[7.0, -7.0, 3.5, -0.0, 0.4]])  # scale 1: ties to even
    assert fake_quantize(x, "int4", granularity="token").tolist() == [[7.0, -7.0, 4.0, -0.0, 0.0]]
    x = torch.tensor([[7.5, -7.5, 3.75, -0.0, 0.5]])  # scale 7.5 / 7.5
    assert fake_quantize(x, "int4", granularity="token", int_range="full").tolist() == [
        [7.0, -8.0, 4.0, -0.0, 0.0]]
    y = torch.tensor([[127.5, -127.5, 1.0]])
    assert fake_quantize(y, "int8", granularity="token", int_range="full").tolist() == [[127.0, -128.0, 1.0]]
    assert saturated(x, "int4", granularity="token", int_range="full").tolist() == [
        [True, False, False, False, False]]


def test_scale_dtype_rounds_the_scale_and_the_quotient():
    """A bf16 input with scale_dtype 'input' equals the computation done in bf16 throughout;
    'float32' does not round the scale; an fp32 input is unaffected by 'input'."""
    x = (torch.randn(4, 96) * 3).to(torch.bfloat16)
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax / torch.tensor(448.0, dtype=torch.bfloat16)  # bf16 division
    want = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.bfloat16) * scale
    assert torch.equal(fake_quantize(x, "fp8_e4m3", granularity="token", scale_dtype="input"), want)
    x32 = x.float()
    assert torch.equal(fake_quantize(x32, "fp8_e4m3", granularity="token", scale_dtype="input"),
                       fake_quantize(x32, "fp8_e4m3", granularity="token"))


def test_amax_override():
    """amax= replaces the tensor amax: the tensor's own amax gives the default result; a
    per-row amax for NVFP4 makes every row what it is quantized alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-2, 2, 5)[:, None]
    for fmt, opts in (("nvfp4", {}), ("nvfp4", {"nvfp4_variant": "compressed-tensors"}),
                      ("fp8_e4m3", {"granularity": "tensor"}), ("int8", {"granularity": "tensor"})):
        own = x.abs().amax()
        assert torch.equal(fake_quantize(x, fmt, amax=own, **opts), fake_quantize(x, fmt, **opts))
        assert not torch.equal(fake_quantize(x, fmt, amax=own * 4, **opts), fake_quantize(x, fmt, **opts))
    rows = x.abs().amax(dim=-1, keepdim=True)
    per_row = fake_quantize(x, "nvfp4", amax=rows)
    for i in range(5):
        assert torch.equal(per_row[i], fake_quantize(x[i], "nvfp4"))
    # static activations: the same amax for every batch, so a row never depends on its batch
    static = torch.tensor(30.0)
    assert torch.equal(fake_quantize(x[:2], "nvfp4", amax=static), fake_quantize(x, "nvfp4", amax=static)[:2])
    out, sat, _ = quantize_with_info(x, "fp8_e4m3", granularity="tensor", amax=torch.tensor(1.0))
    assert torch.equal(out, fake_quantize(x, "fp8_e4m3", granularity="tensor", amax=torch.tensor(1.0)))
    assert bool(sat.any()) and torch.equal(out.abs().max(), torch.tensor(1.0))


def test_amax_reaches_the_gradient_path():
    x = torch.randn(3, 32, requires_grad=True)
    out = fake_quantize(x, "nvfp4", amax=torch.tensor(50.0))
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.equal(out.detach(), fake_quantize(x.detach(), "nvfp4", amax=torch.tensor(50.0)))


def test_describe_never_prints_a_huge_block():
    assert resolve("fp8_e4m3", granularity="channel").describe() == (
        "fp8_e4m3 per channel, rounding=rne, scale_dtype=float32")
    assert resolve("int8", granularity="token", int_range="full").describe() == (
        "int8 per token, rounding=rne, int_range=full, scale_dtype=float32")
    assert resolve("fp8_e5m2", granularity="tensor").describe().startswith("fp8_e5m2 per tensor")
    assert resolve("fp8_e4m3", granularity="tile").describe().startswith("fp8_e4m3 block=128x128")
    assert resolve("fp8_e4m3").describe().startswith("fp8_e4m3 block=128,")
    assert resolve("fp8_e4m3", granularity="tensor", fp8_variant="modelopt").describe() == (
        "fp8_e4m3 per tensor, rounding=rne, scale_dtype=float32, fp8_variant=modelopt")
    cfg = resolve("int8", granularity="channel")
    assert cfg.options() == {"granularity": "channel", "axis": -1, "rounding": "rne",
                             "int_range": "restricted", "scale_dtype": "float32"}
    assert resolve("int8", **cfg.options()) == cfg


def test_encode_reports_one_scale_per_row_or_tensor():
    x = torch.randn(4, 50)
    assert encode(x, "fp8_e4m3", granularity="channel").scale_grid().shape == (4, 1)
    enc = encode(x, "int8", granularity="tensor")
    assert torch.equal(enc.scales, enc.scales[:1].expand(4))


@pytest.mark.parametrize(("call", "message"), [
    (lambda: fake_quantize(torch.ones(2, 8), "mxfp4", granularity="channel"),
     "mxfp4: granularity 'channel' is not available (its scales are e8m0); allowed: block, tile"),
    (lambda: fake_quantize(torch.ones(2, 8), "int8", granularity="chanel"),
     "int8: granularity='chanel' is not allowed (did you mean 'channel'?); allowed: block, "
     "channel, token, tensor, tile"),
    (lambda: fake_quantize(torch.ones(2, 8), "int8", granularity="channel", block_size=4),
     "int8: granularity 'channel' has one scale per whole row; remove block_size"),
    (lambda: fake_quantize(torch.ones(2, 8), "fp8_e4m3", granularity="tensor", block_shape=(2, 2)),
     "fp8_e4m3: granularity 'tensor' has one scale per tensor; remove block_shape"),
    (lambda: fake_quantize(torch.ones(2, 8), "int8", granularity="block", block_shape=(2, 2)),
     "int8: block_shape gives 2D tiles; use granularity 'tile' or a block_size"),
    (lambda: fake_quantize(torch.ones(2, 8), "mxfp4", int_range="full"),
     "mxfp4: int_range='full' applies to INT formats only (int4, int8); mxfp4 has no int_range option"),
    (lambda: fake_quantize(torch.ones(2, 8), "int8", scale_dtype="fp8"),
     "int8: scale_dtype='fp8' is not allowed; allowed: float32, bfloat16, float16, input"),
    (lambda: fake_quantize(torch.ones(2, 8), "mxfp4", amax=torch.tensor(1.0)),
     "mxfp4: amax= sets a tensor-level scale, which this config has none of; it applies to "
     "two-level NVFP4 and to granularity 'tensor' (fp8_*, int4, int8)"),
    (lambda: fake_quantize(torch.ones(2, 8), "fp8_e4m3", granularity="tensor", amax=torch.ones(2, 1)),
     "fp8_e4m3: amax must be a 0-dim tensor; got shape [2, 1]"),
    (lambda: fake_quantize(torch.ones(2, 32), "nvfp4", amax=torch.ones(2)),
     "nvfp4: amax must be a 0-dim tensor or, for NVFP4 blocks, one per row shaped [2, 1] "
     "(x.abs().amax(axis, keepdim=True)); got shape [2]"),
    (lambda: fake_quantize(torch.ones(2, 32), "nvfp4", amax=1.0),
     "nvfp4: amax must be a floating-point tensor, got float"),
    (lambda: fake_quantize(torch.ones(2, 8), "fp8_e4m3", block_size=16),
     "fp8_e4m3: block_size 16 is longer than axis 1 of a tensor of shape [2, 8] (8 elements); "
     "use a block of at most 8, or granularity 'channel' (weights) / 'token' (activations) for "
     "one scale per whole row"),
])
def test_errors_name_the_problem_and_the_fix(call, message):
    with pytest.raises(ValueError, match=exactly(message)):
        call()


def test_block_errors_are_user_errors_and_defaults_are_exempt():
    with pytest.raises(UserError):
        fake_quantize(torch.ones(3, 8), "int8", block_shape=(4, 4))
    # the formats' default blocks and tiles on short dims cover them whole, as they always have
    assert torch.equal(fake_quantize(torch.ones(3, 8), "int8"), fake_quantize(torch.ones(3, 8), "int8", block_size=8))
    assert fake_quantize(torch.ones(3, 8), "fp8_e4m3", granularity="tile").shape == (3, 8)
    assert get("fp8_e4m3").tile == (128, 128) and get("fp8_e4m3").default_block == 128
