"""`qtransform plan` and `qtransform transform` as real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import qtransform
from tests.conftest import REPO, ids

EXAMPLE = REPO / "schemas" / "examples" / "w4a16_mxfp4.json"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtransform.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


def test_plan_and_transform_roundtrip(tmp_path, tiny):
    model_dir = tmp_path / "qwen"
    tiny("qwen2").save_pretrained(model_dir)
    res = _cli("plan", str(model_dir), str(EXAMPLE), "--json")
    assert res.returncode == 0, res.stderr
    sites = {s["name"]: s for s in json.loads(res.stdout)["sites"]}
    assert sites["lm_head"]["actions"] == []
    assert sites["model.layers.1.mlp.down_proj"]["actions"][0]["pass_name"] == "fake_quant"
    res = _cli("transform", str(model_dir), str(EXAMPLE), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "qtransform_policy.json").exists()
    reloaded = qtransform.load_transformed(tmp_path / "out")
    direct = qtransform.transform(qtransform.models.load_model(model_dir), EXAMPLE)
    x = ids()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, direct(input_ids=x).logits)


def test_plan_errors_are_readable(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_haed"],
                                                           "format": "mxfp4"}]}))
    res = _cli("plan", "builtin:qwen2", str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "lm_haed" in res.stderr and "lm_head" in res.stderr
    res = _cli("plan", "Qwen/Qwen2.5-0.5B", str(EXAMPLE))
    assert res.returncode == 2 and "hub ids are not downloaded" in res.stderr
