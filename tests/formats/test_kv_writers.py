"""vLLM's per-token-head KV-cache writers (`int_range` / `fp8_variant` "vllm-per-token-head")
against an independent port of the writer's steps, in the order its Triton kernel runs them
(`_reshape_cache_per_token_head`, vLLM 0.32): amax / QMAX floored at 1e-6, a multiply by the
scale's reciprocal, int8's +-0.5 then truncation by the store, fp8's saturating RNE store."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.formats import fake_quantize
from tests.export.test_onnx_functions import check

INT8 = ("int8", {"granularity": "token", "int_range": "vllm-per-token-head", "rounding": "rna"})
FP8 = ("fp8_e4m3", {"granularity": "token", "fp8_variant": "vllm-per-token-head"})


def engine_writer(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What the engine's cache decodes to, one row per (token, head), written step by step."""
    k = x.to(torch.float32)
    qmax = 127.0 if kind == "int8" else 448.0
    scale = torch.maximum(k.abs().amax(dim=-1, keepdim=True) / qmax, torch.tensor(1e-6))
    kq = k * (1.0 / scale)
    if kind == "int8":
        kq = torch.where(kq >= 0, kq + 0.5, kq - 0.5)
        codes = torch.clamp(kq, -128.0, 127.0).to(torch.int8).to(torch.float32)  # the store truncates
    else:
        codes = torch.clamp(kq, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)
    return codes * scale


def near_ties(rows: int = 256, seed: int = 0) -> torch.Tensor:
    """Rows whose elements sit a few ulps around (k + 1/2) * scale, where a division by the
    scale and a multiply by its reciprocal round to different integers."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(rows, generator=g) * 10 + 0.01
    scale = amax / 127.0
    k = torch.randint(0, 127, (rows, 63), generator=g).float()
    x = (k + 0.5) * scale[:, None]
    steps = torch.randint(-3, 4, x.shape, generator=g)
    for _ in range(3):
        x = torch.where(steps > 0, torch.nextafter(x, torch.tensor(torch.inf)), x)
        x = torch.where(steps < 0, torch.nextafter(x, torch.tensor(-torch.inf)), x)
        steps = steps - steps.sign()
    x = torch.clamp(x, max=amax[:, None])
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    return torch.cat([amax[:, None], x], dim=1)  # the row's amax is its first element


def test_int8_writer_matches_the_engine_where_division_would_not():
    x = near_ties()
    want = engine_writer(x, "int8")
    assert torch.equal(fake_quantize(x, INT8[0], **INT8[1]), want)
    divided = fake_quantize(x, "int8", granularity="token", rounding="rna")  # x / scale
    assert (divided != want).sum() > 100  # the vectors separate the two conversions


def test_fp8_writer_matches_the_engine():
    x = torch.cat([near_ties() * 3.5, torch.randn(64, 64) * 1e-5])
    assert torch.equal(fake_quantize(x, FP8[0], **FP8[1]), engine_writer(x, "fp8"))


def test_tiny_rows_take_the_floor_scale():
    x = torch.full((2, 16), 3e-5)
    x[1] = -2.2e-5
    floor = torch.tensor(1e-6, dtype=torch.float32)
    want = torch.tensor([[30.0], [-22.0]]) * floor  # codes 30 and -22 on the 1e-6 floor
    assert torch.equal(fake_quantize(x, INT8[0], **INT8[1]), want.expand(2, 16))
    assert torch.equal(engine_writer(x, "int8"), want.expand(2, 16))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32, allow_subnormal=True), min_size=64, max_size=64),
       st.sampled_from(["int8", "fp8"]))
def test_any_row_matches_the_engine(values, kind):
    x = torch.tensor(values, dtype=torch.float32).reshape(4, 16)
    fmt, opts = INT8 if kind == "int8" else FP8
    assert torch.equal(fake_quantize(x, fmt, **opts), engine_writer(x, kind))


def test_onnx_bodies_are_bit_exact_on_the_separating_rows():
    x = torch.cat([near_ties(64, seed=3), near_ties(64, seed=4) * 1e-6])
    for static in (True, False):
        check([INT8, FP8], x, static=static)
