"""Models dispatched by accelerate (`device_map` with CPU and disk offload) transform and scan
like the plain model: offloaded modules get their weights from accelerate's hooks at call time,
and a transformed site's graph reads `self.weight` at call time, so it quantizes those."""

from __future__ import annotations

import json

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests.conftest import ids

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

POLICY = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"],
                                      "format": "mxfp4", "tensors": ["weight", "input"]}]}
# layer 0 and the head stay in memory, layer 1 and the norm are offloaded to disk
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
              "model.layers.1": "disk", "model.norm": "disk", "lm_head": "cpu"}


def dispatched(tmp_path) -> torch.nn.Module:
    model = build_tiny("qwen2")
    return accelerate.dispatch_model(model, device_map=DEVICE_MAP,
                                     offload_dir=str(tmp_path / "offload"))


def test_offloaded_weights_are_on_meta_until_called(tmp_path):
    """The case worth testing: between calls the offloaded layer holds no weights."""
    model = dispatched(tmp_path)
    assert model.model.layers[1].mlp.down_proj.weight.device.type == "meta"
    assert model.model.layers[0].mlp.down_proj.weight.device.type == "cpu"


def test_transform_of_a_dispatched_model_equals_the_plain_one(tmp_path):
    plain = qtransform.transform(build_tiny("qwen2"), POLICY)
    offloaded = qtransform.transform(dispatched(tmp_path), POLICY, inplace=True)
    batch = ids(2, 8)
    with torch.no_grad():
        want = plain(batch, use_cache=False).logits
        got = offloaded(batch, use_cache=False).logits
    assert torch.equal(got, want)
    reference = build_tiny("qwen2")
    with torch.no_grad():
        assert not torch.equal(reference(batch, use_cache=False).logits, got)  # it did quantize


def test_scan_of_a_dispatched_model_equals_the_plain_one(tmp_path):
    calib = ids(3, 10)
    want = qtransform.scan_activations(build_tiny("qwen2"), "mxfp4", calib)
    got = qtransform.scan_activations(dispatched(tmp_path), "mxfp4", calib)
    a, b = (json.loads(r.to_json()) for r in (want, got))
    for data in (a, b):
        data["meta"].pop("created")
    assert a["rows"] == b["rows"]
    assert a["meta"]["end_to_end"] == b["meta"]["end_to_end"]
    assert a["meta"]["accumulated"] == b["meta"]["accumulated"]
