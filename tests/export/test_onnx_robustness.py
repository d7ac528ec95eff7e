"""Export robustness: external data, atomic writes, failures that name their cause, the audit."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import qtransform
from qtransform.core.tracing import module_graph
from qtransform.errors import UserError
from qtransform.export.onnx import ExportError, export_onnx, save_model

POLICY = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}]}


@torch.library.custom_op("qtx_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Mysterious(nn.Module):
    """A Linear followed by an op the ONNX exporter has no translation for."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.qtx_test.mystery(self.proj(x))


def small() -> nn.Module:
    torch.manual_seed(0)
    return qtransform.transform(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).eval(), POLICY)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = small()
    return model, export_onnx(model, tmp_path_factory.mktemp("e") / "m.onnx", torch.randn(2, 32))


def test_large_models_use_external_data(exported, tmp_path):
    model, _ = exported
    path = export_onnx(model, tmp_path / "big.onnx", torch.randn(2, 32), external_data_threshold=1000)
    data = tmp_path / "big.onnx.data"
    assert data.exists() and data.stat().st_size > 8000  # the weights live beside the graph
    graph_only = onnx.load(path, load_external_data=False)
    weights = [t for t in graph_only.graph.initializer if t.name.endswith("weight")]
    assert len(weights) == 2 and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)
    onnx.checker.check_model(str(path))
    x = torch.randn(3, 32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input_0": x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    save_model(onnx.load(path), path)  # small again: the stale companion goes too
    assert not data.exists() and onnx.load(path).graph.initializer[0].HasField("raw_data")


def test_a_failed_write_leaves_no_file_and_keeps_the_old_one(exported, tmp_path, monkeypatch):
    _, source = exported
    proto = onnx.load(source)

    def broken(model, f, *args, **kwargs):
        with open(f, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(onnx, "save_model", broken)
    with pytest.raises(OSError, match="disk full"):
        save_model(proto, tmp_path / "new.onnx")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old.onnx"
    old.write_bytes(b"previous export")
    with pytest.raises(OSError):
        save_model(proto, old)
    assert old.read_bytes() == b"previous export" and list(tmp_path.iterdir()) == [old]


def test_an_unsupported_op_is_named(tmp_path):
    model = qtransform.transform(Mysterious().eval(), POLICY)
    with pytest.raises(ExportError, match=r"Mysterious failed: op qtx_test\.mystery"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(2, 32))
    assert list(tmp_path.iterdir()) == []


def test_an_unexportable_fake_quant_names_its_site(tmp_path):
    pol = {"version": 1, "quantize": [{"targets": ["2"], "format": "nvfp4", "rounding": "stochastic"}]}
    model = qtransform.transform(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).eval(), pol)
    with pytest.raises(ExportError, match=r"'2/weight_fake_quant' \(nvfp4\): stochastic rounding"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(2, 32))


def test_the_audit_refuses_a_graph_that_lost_a_fake_quant(tmp_path):
    model = small()
    log = module_graph(model[0]).insertions  # the record export audits, kept on the site module
    log.append(dataclasses.replace(log[0], site="9"))
    with pytest.raises(ExportError, match=r"audit failed: .* 3 fake-quant insertions, .* 2 .*missing .*: 9/weight_fake_quant"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(2, 32))
    assert not (tmp_path / "m.onnx").exists()


def test_user_mistakes(exported, tmp_path):
    model, _ = exported
    with pytest.raises(UserError, match="returned by qtransform.transform"):
        export_onnx(nn.Linear(4, 4), tmp_path / "m.onnx", torch.randn(1, 4))
    with pytest.raises(UserError, match="fake_quant must be one of function, inline, qdq"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(1, 32), fake_quant="QDQ")
    with pytest.raises(UserError, match="noise must be one of input, random, off"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(1, 32), noise="zero")
    with pytest.raises(UserError, match="opset 23 is too old for fake_quant='qdq': use opset >= 24"):
        export_onnx(model, tmp_path / "m.onnx", torch.randn(1, 32), fake_quant="qdq", opset=23)
