"""Runs side by side beyond scans: parity results aligned by their attribution's sites, and the
comparison page rendered by headless Chromium (every site in the DOM, its heatmap drawn)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import qtransform
from qtransform.models import build_tiny
from qtransform.rl import HFEngine, parity
from qtransform.scan import scan_weights
from tests.report.browser import dump_dom, pixel_std, screenshot
from tests.tiny_rl import tiny_qwen2

PROMPTS = [[5, 17, 33, 8], [90, 4, 61, 22, 7]]
COARSE = "model.layers.1.self_attn.v_proj"


def _parity(folder, coarse_format: str) -> None:
    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head", COARSE], "format": "mxfp8_e4m3"},
        {"targets": [COARSE], "format": coarse_format, "block_size": 32}]}
    model = qtransform.transform(tiny_qwen2(), policy)
    parity(model, HFEngine(tiny_qwen2()), PROMPTS, max_new_tokens=6, attribute=True,
           temperature=0.7).save(folder)


def test_parity_runs_side_by_side(tmp_path):
    _parity(tmp_path / "int4", "int4")
    _parity(tmp_path / "mxfp4", "mxfp4")
    result = qtransform.report_runs([tmp_path / "int4", tmp_path / "mxfp4"], tmp_path / "cmp")
    data = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert data["kind"] == "parity" and data == json.loads(json.dumps(result.to_dict()))
    a, b = (json.loads((tmp_path / f / "parity.json").read_text()) for f in ("int4", "mxfp4"))
    assert data["runs"][1]["summary"]["k3_kl"] == b["metrics"]["k3_kl"]
    added = [{r["site"]: r["added"] for r in x["attribution"]} for x in (a, b)]
    assert {s["site"] for s in data["sites"]} == set(added[0]) == set(added[1])
    compared = 0
    for entry in data["sites"]:
        x, y = added[0][entry["site"]], added[1][entry["site"]]
        want = 10 * math.log10(y / x) if x > 0 and y > 0 else None
        got = entry["deltas"][0]["score_db"]
        if want is not None:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
            compared += 1
    assert compared >= 1 and data["sites"][0]["deltas"][0]["rank"] == (
        data["sites"][0]["values"][1]["rank"] - data["sites"][0]["values"][0]["rank"])
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "## Mismatch metrics" in md and f"| k3_kl | {a['metrics']['k3_kl']:.4g} |" in md


def test_chromium_renders_the_comparison_page(tmp_path):
    model = build_tiny("qwen2")  # what builtin:qwen2 is
    for fmt in ("mxfp4", "nvfp4"):  # the CLI writes each scan's own page beside its JSON
        res = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "scan", "builtin:qwen2",
                              "--format", fmt, "--out", str(tmp_path / fmt)],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
    qtransform.report_runs([tmp_path / "mxfp4", tmp_path / "nvfp4"], tmp_path / "cmp")
    page = tmp_path / "cmp" / "comparison.html"
    html = page.read_text()
    assert 'href="../mxfp4/report.html"' in html and 'href="../nvfp4/report.html"' in html
    dom = dump_dom(page, tmp_path)
    assert 'data-figures="drawn"' in dom and dom.count('class="main-svg"') >= 2
    for row in scan_weights(model, "mxfp4").rows:
        assert f"<td>{row.site}</td>" in dom
    assert pixel_std(screenshot(page, tmp_path)) > 0.02
