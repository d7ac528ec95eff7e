"""Export modes on a small MLP: inlined bodies, QDQ, noise as random draws or off, Programs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator
from torch import nn
from torch.nn import functional as F

import qtransform
from qtransform import fake_quantize
from qtransform.errors import UserError
from qtransform.export.functions import DOMAIN
from qtransform.export.graph import config_of, fake_quant_nodes
from qtransform.export.onnx import export_onnx
from tests.helpers import assert_within, gemm_rounding

W4A4 = {"version": 1, "quantize": [
    {"targets": ["0"], "format": "mxfp4", "tensors": ["weight", "input"]},
    {"targets": ["2"], "format": "nvfp4", "tensors": ["weight"]},
    {"targets": ["4"], "format": "int8", "tensors": ["weight", "input"]}]}
NOISY = {**W4A4, "hw_error": {"targets": ["Linear"], "error_type": "absolute_gaussian", "error_scale": 0.1}}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 32)).eval()


def x(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))


def ort_run(path, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def torch_out(model: nn.Module, inp: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(inp)


@pytest.fixture(scope="module")
def model():
    return qtransform.transform(mlp(), W4A4)


@pytest.fixture(scope="module")
def function_file(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("f") / "m.onnx", x())


def test_inline_expands_bodies_into_named_standard_ops(model, function_file, tmp_path):
    path = export_onnx(model, tmp_path / "inline.onnx", x(), fake_quant="inline")
    proto = onnx.load(path)
    assert not proto.functions and all(n.domain == "" for n in proto.graph.node)
    assert any(n.name.startswith("0/weight_fake_quant/") for n in proto.graph.node)
    for batch in (1, 5):
        feeds = {"input_0": x(batch).numpy()}
        assert np.array_equal(ort_run(path, feeds)[0], ort_run(function_file, feeds)[0])


def test_qdq_passes_the_checker_and_the_reference_evaluator(model, tmp_path):
    path = export_onnx(model, tmp_path / "qdq.onnx", x(), fake_quant="qdq")
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version >= 24 and not proto.functions
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("DequantizeLinear") == 3 + 1 + 2  # 3 weights, NVFP4 block scales, 2 activations
    assert ops.count("QuantizeLinear") == 2
    types = {t.name: t.data_type for t in proto.graph.initializer}
    assert types["0/weight_fake_quant/q"] == onnx.TensorProto.FLOAT4E2M1
    assert types["0/weight_fake_quant/scale"] == onnx.TensorProto.FLOAT8E8M0
    assert types["2/weight_fake_quant/block_scale"] == onnx.TensorProto.FLOAT8E4M3FN
    assert types["4/weight_fake_quant/q"] == onnx.TensorProto.INT8
    inp = x()
    got = ReferenceEvaluator(proto).run(None, {"input_0": inp.numpy()})[0]
    want = torch_out(model, inp)
    assert np.abs(got - want.numpy()).max() <= 1e-5 * float(want.abs().max())


def test_qdq_names_the_formats_it_cannot_express(tmp_path):
    pol = {"version": 1, "quantize": [{"targets": ["0"], "format": "mxfp6_e2m3"},
                                      {"targets": ["2"], "format": "mxfp4", "rounding": "rna"}]}
    with pytest.raises(UserError, match=r"mxfp4, mxfp6_e2m3.*0/weight_fake_quant \(mxfp6_e2m3: e2m3 elements"):
        export_onnx(qtransform.transform(mlp(), pol), tmp_path / "q.onnx", x(), fake_quant="qdq")
    assert not (tmp_path / "q.onnx").exists()


def test_noise_modes(tmp_path):
    model = qtransform.transform(mlp(), NOISY)
    inputs = export_onnx(model, tmp_path / "in.onnx", x())
    names = [i.name for i in onnx.load(inputs).graph.input]
    assert names == ["input_0", "noise:0/output", "noise:2/output", "noise:4/output"]
    feeds = {"input_0": x().numpy()} | {n: np.zeros((3, d), np.float32) for n, d in zip(names[1:], (96, 64, 32), strict=True)}
    clean = ort_run(inputs, feeds)[0]

    off = export_onnx(model, tmp_path / "off.onnx", x(), noise="off")
    proto = onnx.load(off)
    assert [i.name for i in proto.graph.input] == ["input_0"]
    assert not any(n.op_type == "Noise" for n in proto.graph.node)
    assert np.array_equal(ort_run(off, {"input_0": x().numpy()})[0], clean)

    rnd = export_onnx(model, tmp_path / "rnd.onnx", x(), noise="random")
    proto = onnx.load(rnd)
    draws = [n for n in proto.graph.node if n.op_type == "RandomNormalLike"]
    assert [i.name for i in proto.graph.input] == ["input_0"] and len(draws) == 3
    assert all(any(a.name == "seed" for a in d.attribute) for d in draws)
    first, again = (ort_run(rnd, {"input_0": x().numpy()})[0] for _ in range(2))
    assert np.array_equal(first, again)  # seeded: a fresh session draws the same numbers
    assert not np.allclose(first, clean)


def test_a_graph_mode_program_exports_and_is_audited_against_its_log(tmp_path):
    program = qtransform.transform_program(mlp(), W4A4, x(), mode="graph")
    path = export_onnx(program, tmp_path / "p.onnx", x())
    proto = onnx.load(path)
    labels = sorted(n.name for n in proto.graph.node if n.domain == DOMAIN)
    assert labels == sorted(f"{i.site}/{i.point}_fake_quant" for i in program.insertions(pass_name="fake_quant"))
    inp = x() + 1.0  # the captured graph module itself only runs at the captured shape
    want = torch_out(program.module(), inp)
    got = ort_run(path, {"input_0": inp.numpy()})[0]
    assert np.abs(got - want.numpy()).max() <= 1e-5 * float(want.abs().max())


STACK_SCHEMES = {"version": 1, "quantize": [
    {"targets": ["0"], "format": "fp8_e4m3", "granularity": "channel"},
    {"targets": ["0"], "format": "fp8_e4m3", "granularity": "token", "tensors": ["input"]},
    {"targets": ["2"], "format": "int8", "granularity": "channel", "int_range": "full"},
    {"targets": ["2"], "format": "int8", "granularity": "token", "int_range": "full", "tensors": ["input"]},
    {"targets": ["4"], "format": "fp8_e5m2", "granularity": "tensor", "tensors": ["weight", "input"]}]}


def ort_run_exposing_fake_quant(path, feeds: dict) -> tuple[np.ndarray, dict[str, tuple]]:
    """onnxruntime's output and, by node name, each fake-quant node's (config, input, output)."""
    proto = onnx.load(path)
    nodes = fake_quant_nodes(proto)
    values = {v for n in nodes for v in (n.input[0], n.output[0])}
    proto.graph.output.extend(helper.make_empty_tensor_value_info(v) for v in sorted(values))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    return out[proto.graph.output[0].name], {
        n.name: (config_of(n)[0], torch.from_numpy(out[n.input[0]]), torch.from_numpy(out[n.output[0]]))
        for n in nodes}


def test_fp8_and_per_channel_token_tensor_scales_export_with_pytorchs_bits(tmp_path):
    """FP8_DYNAMIC- and W8A8-style rules and per-tensor E5M2 run in onnxruntime with PyTorch's
    bits (function mode); QDQ refuses them in one line and writes nothing.

    Bit for bit: every fake-quant node on what onnxruntime gave it (qtransform's own function
    bodies) and the stored weights. The Linears' GEMMs are onnxruntime's (MLAS sums in a
    CPU-dependent order: AVX2 and AVX-512 differ in the last bit), so each layer's output is
    checked against PyTorch's on the same quantized operands, within that rounding; comparing the
    whole MLP's output bit for bit would test MLAS's summation order, and a 1-ulp difference
    can flip a downstream rounding by a whole quantization step."""
    m = qtransform.transform(mlp(), STACK_SCHEMES)
    path = export_onnx(m, tmp_path / "s.onnx", x())
    for batch in (3, 5):
        got, nodes = ort_run_exposing_fake_quant(path, {"input_0": x(batch).numpy()})
        assert sorted(nodes) == sorted(f"{s}/{p}_fake_quant" for s in "024" for p in ("weight", "input"))
        for label, (cfg, given, quantized) in nodes.items():
            assert torch.equal(quantized.view(torch.int32), fake_quantize(given, cfg).view(torch.int32)), label
        assert torch.equal(nodes["0/input_fake_quant"][1], x(batch))
        layer = {}  # site -> PyTorch's Linear on onnxruntime's quantized operands, and its bound
        for site in "024":
            xq, wq = nodes[f"{site}/input_fake_quant"][2], nodes[f"{site}/weight_fake_quant"][2]
            assert torch.equal(nodes[f"{site}/weight_fake_quant"][1], m[int(site)].weight.detach()), site
            layer[site] = (F.linear(xq, wq, m[int(site)].bias.detach()), gemm_rounding(xq, wq))
        y0, bound0 = layer["0"]  # ReLU is exact and 1-Lipschitz: the GEMM's bound carries over
        assert_within(nodes["2/input_fake_quant"][1], F.relu(y0), bound0, "layer 0")
        y2, bound2 = layer["2"]  # GELU: slope <= 1.13, and its erf is onnxruntime's (a few ulps of y)
        gelu_bound = 1.13 * bound2 + 4 * torch.finfo(torch.float32).eps * y2.double().abs()
        assert_within(nodes["4/input_fake_quant"][1], F.gelu(y2), gelu_bound, "layer 2")
        y4, bound4 = layer["4"]
        assert_within(torch.from_numpy(got), y4, bound4, "layer 4")
    with pytest.raises(UserError, match=r"fp8_e4m3, fp8_e5m2, int8: .*\(fp8_e4m3: the fp8 family has no "
                                        r"QDQ form\).*int8: granularity 'channel'"):
        export_onnx(m, tmp_path / "q.onnx", x(), fake_quant="qdq")
    assert not (tmp_path / "q.onnx").exists()


def test_scales_in_the_input_dtype_are_refused_before_anything_is_written(tmp_path):
    """"input" is the exported tensor's dtype: a bf16 export is refused before anything is
    written, an fp32 one takes the float32 bodies."""
    pol = {"version": 1, "quantize": [{"targets": ["0"], "format": "fp8_e4m3", "scale_dtype": "input"}]}
    with pytest.raises(UserError, match=r"0/weight_fake_quant.*scale_dtype 'bfloat16' has no ONNX "
                                        r"body; export the model in float32 or with scale_dtype 'float32'"):
        export_onnx(qtransform.transform(mlp().to(torch.bfloat16), pol), tmp_path / "b.onnx",
                    x().to(torch.bfloat16))
    assert not (tmp_path / "b.onnx").exists()
    export_onnx(qtransform.transform(mlp(), pol), tmp_path / "f.onnx", x())
    assert (tmp_path / "f.onnx").exists()
