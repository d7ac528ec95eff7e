"""Attention fake quantization in ONNX: keys, values and queries (per tensor, per head, per token)
and the engines' attention kernels export, pass the audit (one node per quantized tensor, per
head where each head has its scale) and run in onnxruntime to the PyTorch model's logits (to
LOGIT_RTOL, as every model export here: its matmuls sum in other orders)."""

from __future__ import annotations

import onnx
import pytest
import torch

import qtransform
from qtransform.export.graph import fake_quant_nodes
from qtransform.models import build_tiny
from tests.export.test_onnx_export import LOGIT_RTOL
from tests.export.test_onnx_presets import _relative_error

POLICIES = {
    "llm-compressor kv": {"preset": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"]},
    "per head": {"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "head",
                               "scale_source": "static"}]},
    "vllm cpu": {"preset": "vllm/kv_fp8_e5m2", "preset_options": {"backend": "cpu"}},
    "flash-attn-3": {"preset": "vllm/kv_fp8_e4m3", "preset_options": {"backend": "flash-attn-3"}},
    "per token query": {"quantize": [{"format": "fp8_e4m3", "tensors": ["query"], "granularity": "token"}]},
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_attention_quantization_runs_in_onnxruntime(name, tmp_path):
    model = build_tiny("qwen2", hidden=128)  # 4 query heads over 2 key/value heads
    g = torch.Generator().manual_seed(2)
    calib = [torch.randint(0, 256, (1, 16), generator=g) for _ in range(2)]
    ids = torch.randint(0, 256, (2, 12), generator=g)
    ours = qtransform.transform(model, POLICIES[name], calibration=calib)
    path = qtransform.export_onnx(ours, tmp_path / "m.onnx", {"input_ids": ids[:1]})
    quantizers = [m for m in ours.modules() if isinstance(m, qtransform.passes.FakeQuantize)]
    assert len(fake_quant_nodes(onnx.load(str(path)))) == len(quantizers)  # a node each, per head too
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert float((ours(input_ids=ids).logits - plain).abs().max()) > 1e-4  # it quantizes something
    assert _relative_error(path, ours, ids) < LOGIT_RTOL
