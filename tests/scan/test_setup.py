"""The one scan setup: what a format, a policy, options and W4A4 mean (the CLI's options, from
Python), and the prologue every scan on calibration data starts from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.scan import scan_activations
from qtransform.scan.setup import CalibrationSpec, prepare_scan, scan_policy
from qtransform.schemas import dump_policy
from tests.conftest import ids
from tests.helpers import assert_untouched, snapshot

POLICY = {"version": 1, "quantize": [
    {"name": "attn", "targets": ["re:.*self_attn.*"], "format": "mxfp4"},
    {"name": "mlp", "targets": ["re:.*mlp.*"], "ignore": ["model.layers.1.mlp.down_proj"], "format": "mxfp6_e2m3"}]}


def _rules(policy) -> list[dict]:
    return dump_policy(policy)["quantize"]


def test_scan_policy_means_what_the_command_line_options_mean():
    model = build_tiny("qwen2")
    bare = _rules(scan_policy(model, "nvfp4"))
    assert len(bare) == 1 and bare[0]["targets"] == ["Linear"] and bare[0]["ignore"] == ["lm_head"]
    assert bare[0]["format"] == "nvfp4" and bare[0]["tensors"] == ["weight"]
    rules = _rules(scan_policy(model, "nvfp4", POLICY, options={"block_size": 32}, activations=True))
    assert [(r["name"], r["format"], r["block_size"], r["tensors"]) for r in rules] == [
        ("attn", "nvfp4", 32, ["weight", "input"]), ("mlp", "nvfp4", 32, ["weight", "input"])]
    assert rules[1]["ignore"] == ["model.layers.1.mlp.down_proj"]  # the policy still selects
    kept = _rules(scan_policy(model, None, POLICY))
    assert [(r["format"], r.get("tensors", ["weight"])) for r in kept] == [("mxfp4", ["weight"]),
                                                                         ("mxfp6_e2m3", ["weight"])]
    with pytest.raises(UserError, match="give a format"):
        scan_policy(model)


def test_prepare_scan_is_the_common_prologue():
    model = build_tiny("qwen2")
    before = snapshot(model)
    calib = ids(5, 9)
    setup = prepare_scan(model, POLICY, CalibrationSpec(calib, batch_size=2))
    assert_untouched(before, model)  # a copy is transformed
    assert setup.quant is not model and setup.causal
    assert [b.shape[0] for b in setup.batches] == [2, 2, 1]
    assert torch.equal(torch.cat(setup.batches), calib)
    assert setup.calibration_meta() == {"batches": 3, "samples": 5, "batch_size": 2, "max_length": 128}
    quantized = [f"model.layers.{i}.{m}" for i in (0, 1) for m in
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")][:-1]
    assert setup.sites == quantized  # instrumented where the policy quantizes
    plain = prepare_scan(model, POLICY, calib, instrument=False)
    assert plain.sites == quantized and plain.policy.instrument is None
    assert setup.stride(None) == 1 and setup.stride(3) == 3


def test_float_inputs_follow_the_model_dtype():
    """A bf16 plain torch model scanned on fp32 inputs: the setup puts the batches in the
    model's dtype (they reached the model as fp32 and failed in its first matmul)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16)).to(torch.bfloat16).eval()
    x = torch.randn(6, 32)
    setup = prepare_scan(model, "mxfp4", CalibrationSpec(x, batch_size=4))
    assert [b.dtype for b in setup.batches] == [torch.bfloat16] * 2
    report = scan_activations(model, "mxfp4", x, batch_size=4)
    assert {r.site for r in report.rows} == {"0", "2"}
    assert report.meta["end_to_end"]["sqnr_db"] > 10


def test_a_calibration_source_is_read_once_and_recorded(tmp_path, monkeypatch):
    """What `--calib` names ("builtin", else a file, even one called builtin) becomes a spec that
    every scan takes as its `calib`, and the report records where the samples came from."""
    from qtransform.calibration import builtin_calibration
    from qtransform.scan.sensitivity import site_sensitivity

    assert CalibrationSpec.read("builtin").data == builtin_calibration()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "builtin").write_text("[[1, 2, 3], [4, 5, 6]]")
    assert CalibrationSpec.read("builtin").data == ["[[1, 2, 3], [4, 5, 6]]"]  # a text file
    data = tmp_path / "ids.json"
    data.write_text("[[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]")
    spec = CalibrationSpec.read(str(data), batch_size=2)
    model = build_tiny("qwen2")
    report = scan_activations(model, "mxfp4", spec, batch_size=99)  # the spec's settings hold
    assert report.meta["calibration"] == {"batches": 2, "samples": 3, "batch_size": 2, "max_length": 128,
                                          "token_stride": 1, "file": str(data)}
    sens = site_sensitivity(model, "mxfp4", spec).meta["calibration"]
    assert sens == {"batches": 2, "samples": 3, "batch_size": 2, "max_length": 128, "tokens": 12,
                    "file": str(data)}
