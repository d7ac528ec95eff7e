"""The clamp pass: the extension example (a pass file, its section, this test)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torch import nn

import qtransform
from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas.explain import explain


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


POLICY = {"version": 1, "clamp": {"targets": ["0"], "limit": 0.25}}


def test_the_selected_output_is_clamped_and_nothing_else():
    model = mlp()
    out = qtransform.transform(model, POLICY)
    x = torch.randn(5, 16) * 4
    hidden = (x @ model[0].weight.T + model[0].bias).clamp(-0.25, 0.25)  # written out by hand
    expected = torch.relu(hidden) @ model[2].weight.T + model[2].bias
    assert torch.equal(out(x), expected)
    assert [r.detail for r in qtransform.plan(model, POLICY).rows] == ["±0.25"]


def test_the_section_validates_and_explains_itself():
    assert explain(load_policy(POLICY)) == (
        "Clamp: the outputs of modules matching 0 are clamped to ±0.25.")
    with pytest.raises(PolicyError, match="clamp.limit"):
        load_policy({"version": 1, "clamp": {"limit": -1}})
    with pytest.raises(PolicyError, match="clamp.point"):
        load_policy({"version": 1, "clamp": {"limit": 1, "point": "outputs"}})


def test_it_runs_after_fake_quant_and_exports_to_onnx(tmp_path):
    pol = {**POLICY, "quantize": [{"targets": ["0"], "format": "mxfp8_e4m3"}]}
    model = qtransform.transform(mlp(), pol)
    names = [n for n, _ in model[0].named_children()]
    assert names == ["weight_fake_quant", "output_clamp"]
    x = torch.randn(3, 16) * 4
    path = qtransform.export_onnx(model, tmp_path / "m.onnx", x, dynamic=False)
    sess = ort.InferenceSession(str(path))
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-5, atol=1e-6)
