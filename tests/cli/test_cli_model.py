"""`qtransform plan` and `qtransform transform` as real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import qtransform
from tests.conftest import REPO, ids
from tests.helpers import TOKENIZER_TEXT, tiny_bpe_tokenizer

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


def test_transform_keeps_the_tokenizer_so_text_scans_run_on_the_saved_folder(tmp_path, tiny):
    """A model folder with a tokenizer gives a transformed folder with it: `scan --calib` with
    text needs it (it failed with "text calibration needs the model's tokenizer")."""
    model_dir = tmp_path / "qwen"
    tiny("qwen2").save_pretrained(model_dir)
    tiny_bpe_tokenizer().save_pretrained(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(TOKENIZER_TEXT) + "\n")
    res = _cli("transform", str(model_dir), str(EXAMPLE), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    source, saved = (qtransform.models.load_tokenizer(p) for p in (model_dir, tmp_path / "out"))
    assert saved is not None and saved(TOKENIZER_TEXT)["input_ids"] == source(TOKENIZER_TEXT)["input_ids"]
    res = _cli("scan", str(tmp_path / "out"), "--format", "mxfp4", "--calib", str(calib),
               "--out", str(tmp_path / "scan"), "--no-onnx", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "scan" / "report.json").read_text())
    assert report["rows"], report


def test_save_transformed_carries_the_tokenizer_of_the_source_folder(tmp_path, tiny):
    tiny("qwen2").save_pretrained(tmp_path / "src")
    tiny_bpe_tokenizer().save_pretrained(tmp_path / "src")
    want = tiny_bpe_tokenizer()(TOKENIZER_TEXT)["input_ids"]
    model = qtransform.transform(qtransform.models.load_model(tmp_path / "src"), EXAMPLE)
    qtransform.save_transformed(model, EXAMPLE, tmp_path / "a")
    assert qtransform.models.load_tokenizer(tmp_path / "a")(TOKENIZER_TEXT)["input_ids"] == want
    built = qtransform.transform(tiny("qwen2"), EXAMPLE)  # config-built: no tokenizer anywhere
    qtransform.save_transformed(built, EXAMPLE, tmp_path / "b")
    assert qtransform.models.load_tokenizer(tmp_path / "b") is None
    qtransform.save_transformed(built, EXAMPLE, tmp_path / "c", tokenizer=tiny_bpe_tokenizer())
    assert qtransform.models.load_tokenizer(tmp_path / "c")(TOKENIZER_TEXT)["input_ids"] == want


STATIC = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
                                      "tensors": ["weight", "input"], "scale_source": "static",
                                      "share_scale": "fused"}]}


def test_calib_calibrates_static_scales_in_transform_plan_and_export(tmp_path, tiny):
    model_dir = tmp_path / "qwen"
    tiny("qwen2").save_pretrained(model_dir)
    policy = tmp_path / "static.json"
    policy.write_text(json.dumps(STATIC))
    calib = tmp_path / "calib.json"
    samples = [[int(t) for t in row] for row in torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(3))]
    calib.write_text(json.dumps(samples))
    res = _cli("transform", str(model_dir), str(policy), "--out", str(tmp_path / "none"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--calib FILE" in res.stderr and "calibration=batches" in res.stderr
    res = _cli("transform", str(model_dir), str(policy), "--out", str(tmp_path / "out"), "--calib", str(calib))
    assert res.returncode == 0, res.stderr
    reloaded = qtransform.load_transformed(tmp_path / "out")
    direct = qtransform.transform(qtransform.models.load_model(model_dir), STATIC,
                                  calibration=[torch.tensor(samples)])
    x = ids()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, direct(input_ids=x).logits)
    res = _cli("policy", "explain", str(tmp_path / "out" / "qtransform_policy.json"))
    assert res.returncode == 0, res.stderr
    amax = reloaded.model.layers[0].mlp.down_proj.input_fake_quant.static_scale.amax.item()
    assert f"model.layers.0.mlp.down_proj.input_fake_quant: {amax:.6g}" in res.stdout
    res = _cli("plan", str(model_dir), str(policy), "--calib", str(calib))
    assert res.returncode == 0, res.stderr
    assert "global_scale=static (static_minmax), amax=" in res.stdout
    assert "global scale shared with model.layers.0.self_attn.k_proj" in res.stdout
    res = _cli("export", str(model_dir), "--policy", str(policy), "--out", str(tmp_path / "m.onnx"),
               "--calib", str(calib))
    assert res.returncode == 0, res.stderr
