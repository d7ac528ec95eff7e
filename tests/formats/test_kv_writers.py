"""vLLM's per-token-head KV-cache writers (`int_range` / `fp8_variant` "vllm-per-token-head")
against an independent port of the writer's steps, in the order its Triton kernel runs them
(`_reshape_cache_per_token_head`, vLLM 0.32): amax / QMAX floored at 1e-6, a multiply by the
scale's reciprocal, int8's +-0.5 then truncation by the store, fp8's saturating RNE store."""

from __future__ import annotations

import math

import numpy as np
import pytest
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


# -- NVFP4 (vLLM's `reshape_and_cache_nvfp4_kernel`, `cvt_warp_fp16_to_fp4[_4over6]`) ---------

E2M1_UP = [(0.25, 0.0), (0.75, 0.5), (1.25, 1.0), (1.75, 1.5), (2.5, 2.0), (3.5, 3.0), (5.0, 4.0)]


def e2m1_table(v: np.float32) -> np.float32:
    """The kernel's `round_to_nearest_e2m1` thresholds (ties to even), saturating at 6."""
    a = abs(float(v))
    q = 6.0
    for i, (edge, value) in enumerate(E2M1_UP):
        if (a <= edge) if i % 2 == 0 else (a < edge):
            q = value
            break
    return np.float32(math.copysign(q, float(v)))


def nvfp4_writer(block: np.ndarray, k: float, four_over_six: bool, divide: bool = False) -> np.ndarray:
    """One 16-value block, scalar fp32 steps in the kernel's order; returns (q * SF) * k.
    `divide`: the encode scale as g / SF instead of the kernel's 1 / (SF * (1 / g))."""
    f = np.float32
    g = f(1.0) / f(k)
    vec_max = f(np.max(np.abs(block)))

    def candidate(den: float):
        sf = f(torch.tensor(float(g * (vec_max * (f(1.0) / f(den))))).clamp_max(448)
               .to(torch.float8_e4m3fn).float())
        enc = (g / sf if divide else f(1.0) / (sf * (f(1.0) / g))) if sf != 0 else f(0.0)
        return sf, enc

    def error(enc):
        err = f(0.0)
        dec = f(1.0) / enc if enc != 0 else f(0.0)
        for i in range(0, 16, 2):
            x0, x1 = block[i], block[i + 1]
            if enc == 0:
                err = err + (x0 * x0 + x1 * x1)
            else:
                d0, d1 = e2m1_table(x0 * enc) * dec - x0, e2m1_table(x1 * enc) * dec - x1
                err = err + (d0 * d0 + d1 * d1)
        return err

    sf, enc = candidate(6.0)
    if four_over_six:
        sf4, enc4 = candidate(4.0)
        if error(enc4) < error(enc):
            sf, enc = sf4, enc4
    return np.array([(e2m1_table(v * enc) * sf) * f(k) for v in block], dtype=np.float32)


def nvfp4_rows(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    x[0, :16] = torch.tensor([6, 0.5, 2.5, 1, 0, -3, 0.25, 4, 5, -5, 1.5, 0.75, 2, -6, 3.5, 1.25])  # table edges
    x[1, :16] = 0.0
    return x.bfloat16().float()  # the engine writes bf16 keys and values


@pytest.mark.parametrize("four_over_six", [False, True])
def test_nvfp4_writer_equals_the_kernel_steps(four_over_six):
    x = nvfp4_rows(24, seed=1)
    k = float(x.abs().max() / 448)
    separating = nvfp4_rows(512, seed=5)  # with k = 0.37 some blocks encode apart under g / SF
    for rows, scale in ((x, k), (separating, 0.37)):
        check_nvfp4_writer(rows, scale, four_over_six)
    blocks = separating.numpy().reshape(-1, 16)
    assert sum(not np.array_equal(nvfp4_writer(b, 0.37, four_over_six),
                                  nvfp4_writer(b, 0.37, four_over_six, divide=True)) for b in blocks) > 3


def check_nvfp4_writer(x: torch.Tensor, k: float, four_over_six: bool) -> None:
    opts = {"nvfp4_variant": "vllm-kv", **({"four_over_six": "mse"} if four_over_six else {})}
    got = fake_quantize(x, "nvfp4", scale=torch.tensor(k), **opts)
    blocks = x.numpy().reshape(-1, 16)
    want = np.stack([nvfp4_writer(b, k, four_over_six) for b in blocks]).reshape(x.shape)
    assert np.array_equal(got.numpy(), want)
    if four_over_six:  # the choice changes blocks, and only ever lowers their squared error
        plain = fake_quantize(x, "nvfp4", scale=torch.tensor(k), nvfp4_variant="vllm-kv")
        moved = (got != plain).reshape(-1, 16).any(dim=1)
        assert moved.sum() > 5
        err = ((got - x) ** 2).reshape(-1, 16).sum(1)
        assert (err[moved] <= ((plain - x) ** 2).reshape(-1, 16).sum(1)[moved] * (1 + 1e-6)).all()


def test_nvfp4_writer_onnx_is_bit_exact():
    x = nvfp4_rows(32, seed=2)
    cases = [("nvfp4", {"nvfp4_variant": "vllm-kv"}),  # k = the tensor's amax / 448
             ("nvfp4", {"nvfp4_variant": "vllm-kv", "four_over_six": "mse"})]
    for static in (True, False):
        check(cases, x, static=static)


def test_nvfp4_writer_refuses_mae_in_one_line():
    with pytest.raises(ValueError, match="squared error only") as exc:
        fake_quantize(torch.ones(2, 16), "nvfp4", nvfp4_variant="vllm-kv", four_over_six="mae")
    assert "\n" not in str(exc.value)


# -- NVFP4, FlashInfer's writer (`nvfp4_append_quantize_block`, page.cuh) --------------------------

def flashinfer_writer(block: np.ndarray, k: float) -> np.ndarray:
    """One 16-value block, scalar fp32 steps in FlashInfer's order; returns (q * SF) * k."""
    f = np.float32
    amax = f(np.max(np.abs(block)))
    sf_value = amax / (f(6.0) * f(k)) if amax > 0 else f(0.0)
    sf = f(torch.tensor(float(sf_value)).clamp_max(448).to(torch.float8_e4m3fn).float())
    enc = f(1.0) / (sf * f(k)) if (amax > 0 and sf > 0) else f(0.0)
    return np.array([(e2m1_table(v * enc) * sf) * f(k) for v in block], dtype=np.float32)


def threshold_blocks(k: float, blocks: int, seed: int) -> torch.Tensor:
    """Blocks whose elements sit on, or an ulp around, E2M1's rounding edges times the block's
    scale SF · k, where the two writers' encode scales (1 / (SF · k) against 1 / (SF · fl(1 /
    fl(1 / k)))) can round an element to different codes."""
    f = np.float32
    rng = np.random.default_rng(seed)
    out = np.zeros((blocks, 16), dtype=f)
    for r in range(blocks):
        amax = f(rng.uniform(0.5, 50))
        sf = f(torch.tensor(float(amax / (f(6) * f(k)))).to(torch.float8_e4m3fn).float())
        out[r, 0] = amax
        for i in range(1, 16):
            v = f(E2M1_UP[i % 7][0]) * sf * f(k)
            out[r, i] = np.nextafter(v, f(np.inf) if rng.random() < 0.5 else f(-np.inf)) if rng.random() < 0.7 else v
    return torch.from_numpy(out).reshape(-1, 64)


def test_flashinfer_writer_equals_its_steps_and_differs_from_vllms():
    k_apart = 1.914515495300293  # fl(1 / fl(1 / k)) != k
    separating = threshold_blocks(k_apart, 256, seed=0)
    x = nvfp4_rows(24, seed=1)
    for rows, k in ((x, float(x.abs().max() / 448)), (nvfp4_rows(256, seed=5), 1.0), (separating, k_apart)):
        got = fake_quantize(rows, "nvfp4", scale=torch.tensor(k), nvfp4_variant="flashinfer-kv")
        blocks = rows.numpy().reshape(-1, 16)
        want = np.stack([flashinfer_writer(b, k) for b in blocks]).reshape(rows.shape)
        assert np.array_equal(got.numpy(), want)
    blocks = separating.numpy().reshape(-1, 16)
    assert sum(not np.array_equal(flashinfer_writer(b, k_apart), nvfp4_writer(b, k_apart, False)) for b in blocks) > 5
    vllm = fake_quantize(separating, "nvfp4", scale=torch.tensor(k_apart), nvfp4_variant="vllm-kv")
    assert not torch.equal(vllm, fake_quantize(separating, "nvfp4", scale=torch.tensor(k_apart),
                                               nvfp4_variant="flashinfer-kv"))


def test_flashinfer_writer_onnx_is_bit_exact_and_refuses_four_over_six():
    for static in (True, False):
        check([("nvfp4", {"nvfp4_variant": "flashinfer-kv"})], nvfp4_rows(32, seed=2), static=static)
    with pytest.raises(ValueError, match="has no four over six") as exc:
        fake_quantize(torch.ones(2, 16), "nvfp4", nvfp4_variant="flashinfer-kv", four_over_six="mse")
    assert "\n" not in str(exc.value)
