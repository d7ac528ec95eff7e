"""An `attention_mask` input in the exported file: padded batches give the PyTorch model's
outputs for their real tokens in onnxruntime (left and right padding), and unpadded batches
still run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny
from tests.conftest import REPO

W4A16 = REPO / "schemas" / "examples" / "w4a16_mxfp4.json"
ATOL = 1e-4  # onnxruntime's matmul order differs from PyTorch's; fake-quant itself is bit-exact


def padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with rows of every real length: row 0 left-padded, row 1
    right-padded, row 2 full, further rows alternating."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        real = length if row == 2 else max(1, length - 1 - row)
        if row % 2 == 0 and row != 2:
            mask[row, : length - real] = 0
        elif row != 2:
            mask[row, real:] = 0
    return ids, mask


def assert_real_tokens_match(session: ort.InferenceSession, model, ids, mask) -> None:
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits.numpy()
    real = mask.bool().numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got[real], want[real], rtol=ATOL, atol=ATOL)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = qtransform.transform(build_tiny("qwen2"), W4A16)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    path = qtransform.export_onnx(model, tmp_path_factory.mktemp("mask") / "q.onnx", {"input_ids": ids},
                                  attention_mask=True, taps=False)
    return model, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_mask_is_an_input_with_dynamic_batch_and_sequence(exported):
    _, session = exported
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert list(inputs) == ["input_ids", "attention_mask"]
    assert all(isinstance(d, str) for d in inputs["attention_mask"])  # symbolic dims


@pytest.mark.parametrize(("batch", "length"), [(4, 9), (3, 5), (5, 12)])
def test_left_and_right_padded_batches_match_torch_on_real_tokens(exported, batch, length):
    model, session = exported
    ids, mask = padded(batch, length, seed=batch * length)
    assert (mask[0, 0] == 0) and (mask[1, -1] == 0) and bool(mask[2].all())
    assert_real_tokens_match(session, model, ids, mask)


def test_an_unpadded_batch_gives_the_unmasked_model(exported):
    model, session = exported
    ids = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(5))
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": np.ones((3, 7), np.int64)})[0]
    with torch.no_grad():
        want = model(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=ATOL, atol=ATOL)


def test_a_forward_without_a_mask_is_a_clear_error(tmp_path):
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.proj(x)

    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}]}
    model = qtransform.transform(Plain(), policy)
    with pytest.raises(UserError, match="Plain.forward takes no attention_mask"):
        qtransform.export_onnx(model, tmp_path / "p.onnx", torch.randn(2, 32), attention_mask=True)
    assert not (tmp_path / "p.onnx").exists()


def test_the_cli_flag_exports_the_mask(tmp_path):
    out = tmp_path / "q.onnx"
    res = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "export", "builtin:gpt2",
                          "--policy", str(W4A16), "--out", str(out), "--attention-mask", "--no-taps",
                          "--noise", "off", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["inputs"] == ["input_ids", "attention_mask"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    model = qtransform.transform(build_tiny("gpt2"), W4A16)
    ids, mask = padded(3, 6, seed=1)
    assert_real_tokens_match(session, model, ids, mask)
