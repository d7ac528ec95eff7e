"""ONNX forms of tensor-level amaxes that are not the tensor's own: per token (NVFP4 activations),
a fixed value (a calibrated static scale, a scale group's), or a checkpoint's stored tensor scale;
bit for bit against `fake_quantize(..., amax=)` / `(scale=)` in onnxruntime, and through a whole
exported model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import qtransform
from qtransform import fake_quantize
from qtransform.export.functions import DOMAIN, attributes, fake_quant_function, overload
from qtransform.formats import QuantConfig
from qtransform.models import build_tiny
from tests.export.test_onnx_functions import adversarial, bit_mismatches, run

CASES = [
    ("nvfp4", {}, {"global_scale": "token"}),
    ("nvfp4", {"nvfp4_variant": "compressed-tensors"}, {"global_scale": "token"}),
    ("nvfp4", {}, {"global_amax": 3.3112604618072510}),
    ("nvfp4", {"nvfp4_variant": "compressed-tensors"}, {"global_amax": 0.0}),
    ("nvfp4", {"nvfp4_variant": "modelopt"}, {"global_amax": 3.3112604618072510}),  # ModelOpt's input_scale
    ("nvfp4", {"nvfp4_variant": "modelopt"}, {"global_amax": 0.0}),
    ("fp8_e4m3", {"granularity": "tensor"}, {"global_amax": 17.25}),
    ("int8", {"granularity": "tensor", "int_range": "full"}, {"global_amax": 2.5}),
    # a checkpoint's stored tensor scale, used as it is (`fake_quantize`'s scale=)
    ("nvfp4", {"nvfp4_variant": "compressed-tensors"}, {"tensor_scale": 2144.0}),
    ("nvfp4", {"nvfp4_variant": "modelopt"}, {"tensor_scale": 0.0012318840296939015}),
    ("fp8_e4m3", {"granularity": "tensor"}, {"tensor_scale": 0.0390625}),
    ("fp8_e4m3", {"granularity": "tensor", "fp8_variant": "modelopt"}, {"tensor_scale": 0.0390625}),
    ("int8", {"granularity": "tensor", "int_range": "full"}, {"tensor_scale": 0.02}),
]


def model_for(cases, shape, static):
    nodes, outputs, functions = [], [], {}
    for i, (fmt, opts, extra) in enumerate(cases):
        cfg = QuantConfig.from_options(fmt, opts).bind(-1)
        node = helper.make_node(cfg.spec.onnx_op, ["x"], [f"y{i}"], domain=DOMAIN, name=f"fq{i}",
                                **attributes(cfg), **extra)
        node.overload = overload(cfg, static, extra)
        nodes.append(node)
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, shape))
        functions.setdefault((cfg.spec.onnx_op, node.overload), fake_quant_function(cfg, 21, static, extra))
    graph = helper.make_graph(nodes, "fq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                              functions=list(functions.values()), ir_version=10)
    onnx.checker.check_model(model)
    return model


def want(x, fmt, opts, extra):
    cfg = QuantConfig.from_options(fmt, opts).bind(-1)
    if "tensor_scale" in extra:
        return fake_quantize(x, cfg, scale=torch.tensor(extra["tensor_scale"], dtype=torch.float32))
    if "global_amax" in extra:
        amax = torch.tensor(extra["global_amax"], dtype=torch.float32)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True)
    return fake_quantize(x, cfg, amax=amax)


@pytest.mark.parametrize("static", [True, False])
def test_global_amax_bodies_are_bit_exact(static):
    x = adversarial(48, 208)
    x = x[~torch.isnan(x).any(-1) & ~torch.isinf(x).any(-1)]  # finite rows: the amax is given
    shape = list(x.shape) if static else ["rows", "cols"]
    outs = run(model_for(CASES, shape, tuple(x.shape) if static else None), x.numpy())
    for (fmt, opts, extra), got in zip(CASES, outs, strict=True):
        assert bit_mismatches(torch.from_numpy(got), want(x, fmt, opts, extra)) == 0, (fmt, opts, extra)


def test_overloads_tell_fixed_amaxes_apart():
    cfg = QuantConfig.from_options("nvfp4").bind(-1)
    names = {overload(cfg, None, e) for e in ({}, {"global_scale": "token"}, {"global_amax": 1.0},
                                             {"global_amax": 2.0}, {"tensor_scale": 1.0})}
    assert len(names) == 5


@pytest.mark.parametrize("policy", [
    {"quantize": [{"format": "nvfp4", "ignore": ["lm_head"], "tensors": ["weight", "input"],
                   "share_scale": "fused", "scale_source": "static"}]},
    {"quantize": [{"format": "nvfp4", "ignore": ["lm_head"], "tensors": ["weight", "input"]}]},
])
def test_exported_model_runs_the_same_fake_quants(policy, tmp_path):
    model = build_tiny("qwen2")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    t = qtransform.transform(model, {"version": 1, **policy}, calibration=[ids])
    path = qtransform.export_onnx(t, tmp_path / "m.onnx", {"input_ids": ids})
    proto = onnx.load(path)
    nodes = {n.name: n for n in proto.graph.node if n.domain == DOMAIN}
    q_in = nodes["model.layers.0.self_attn.q_proj/input_fake_quant"]
    attrs = {a.name for a in q_in.attribute}
    assert ("global_amax" in attrs) == ("scale_source" in policy["quantize"][0])
    assert ("global_scale" in attrs) != ("scale_source" in policy["quantize"][0])
    import onnxruntime as ort
    got = ort.InferenceSession(str(path)).run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        ref = t(input_ids=ids).logits.numpy()
    assert np.abs(got - ref).max() < 1e-5


def test_qdq_refuses_global_amaxes(tmp_path):
    model = build_tiny("qwen2")
    policy = {"version": 1, "quantize": [{"format": "nvfp4", "ignore": ["lm_head"], "share_scale": "fused"}]}
    t = qtransform.transform(model, policy)
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(qtransform.UserError, match="no QDQ form"):
        qtransform.export_onnx(t, tmp_path / "m.onnx", {"input_ids": ids}, fake_quant="qdq")
