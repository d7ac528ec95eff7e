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
from qtransform.export.rotation_onnx import rotate_nodes
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


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_rotated_queries_and_keys_export_before_the_key_quantizer(granularity, tmp_path):
    model = build_tiny("qwen2", hidden=128)
    kv = {"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": granularity}
    ours = qtransform.transform(model, {"rotate": [{"point": "query_key", "block_size": 8}], "quantize": [kv]})
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    path = qtransform.export_onnx(ours, tmp_path / "m.onnx", {"input_ids": ids[:1]})
    proto = onnx.load(str(path))
    sites = [f"model.layers.{i}.self_attn" for i in range(2)]
    nodes = {n.name: n for n in rotate_nodes(proto)}
    assert sorted(nodes) == sorted(f"{s}/{p}_rotate" for s in sites for p in ("query", "key"))
    producer = {out: n for n in proto.graph.node for out in n.output}
    keys = [n for n in fake_quant_nodes(proto) if "/key" in n.name]
    assert len(keys) == 2 * (1 if granularity == "tensor" else model.config.num_key_value_heads)
    for node in keys:  # every key quantizer reads its site's rotated key
        source = producer[node.input[0]]
        while source.name not in nodes:  # per head: a slice of the rotated key
            source = producer[source.input[0]]
        assert source.name == node.name.split("/key")[0] + "/key_rotate"
    with torch.no_grad():
        unrotated = qtransform.transform(model, {"quantize": [kv]})(input_ids=ids).logits
    assert not torch.equal(ours(input_ids=ids).logits, unrotated)
    assert _relative_error(path, ours, ids) < LOGIT_RTOL
