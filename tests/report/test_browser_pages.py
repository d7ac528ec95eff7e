"""Every kind of result page, as the CLI writes it, rendered by headless Chromium.

Each command runs as a real subprocess on a tiny model; the page is rendered with `--dump-dom`
(after its scripts ran) and `--screenshot`. A page must list every site of its result in its
table, draw its figures (plotly's SVG), fetch nothing from the network, and not be blank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qtransform.scan.report import ScanReport
from qtransform.scan.sensitivity_report import SensitivityReport
from tests.report.browser import dump_dom, pixel_std, screenshot
from tests.report.test_page import network_references

REPO = Path(__file__).resolve().parents[2]
W4A16 = REPO / "schemas" / "examples" / "w4a16_mxfp4.json"


def cli(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "qtransform.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr  # 1: problems found, still a written report
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One run of every command that writes a page, on tiny models."""
    d = tmp_path_factory.mktemp("runs")
    (d / "ids.json").write_text(json.dumps([[(7 * i + j) % 200 + 1 for j in range(16)] for i in range(4)]))
    cli("scan", "builtin:qwen2", "--format", "mxfp4", "--out", "weights", "--no-progress", cwd=d)
    cli("scan", "builtin:qwen2", "--format", "mxfp4", "--calib", "ids.json", "--out", "activations",
        "--no-progress", cwd=d)
    cli("compare", "builtin:qwen2", "--formats", "mxfp4,nvfp4", "--out", "compare", "--no-progress",
        cwd=d)
    cli("sensitivity", "builtin:qwen2", "--format", "mxfp4", "--calib", "ids.json", "--method",
        "estimate", "--out", "sensitivity", "--no-progress", cwd=d)
    cli("guide", "weights/report.json", "--out", "policy.json", cwd=d)
    cli("parity", "builtin:qwen2", "--policy", str(W4A16), "--engine", "clean", "--attribute",
        "--max-new-tokens", "3", "--num-prompts", "2", "--out", "parity", cwd=d)
    cli("export", "builtin:qwen2", "--policy", str(W4A16), "--out", "model.onnx", "--seq-len", "8",
        "--batch", "1", "--static", cwd=d)
    return d


def weight_sites(d: Path) -> list[str]:
    return [r.label for r in ScanReport.load(d / "weights").rows]


# page, the sites its table must show (from the result's own files), minimum figures drawn
PAGES = {
    "weight scan": ("weights/report.html", lambda d: [r.site for r in ScanReport.load(d / "weights").rows], 2),
    "activation scan": ("activations/report.html",
                        lambda d: [r.site for r in ScanReport.load(d / "activations").rows], 4),
    "compare": ("compare/comparison.html", lambda d: [r.site for r in ScanReport.load(d / "weights").rows], 3),
    "sensitivity": ("sensitivity/sensitivity.html",
                    lambda d: [r.site for r in SensitivityReport.load(d / "sensitivity").rows], 2),
    "guide": ("policy.html", None, 1),
    "parity": ("parity/parity.html",
               lambda d: [a["site"] for a in json.loads((d / "parity" / "parity.json").read_text())["attribution"]], 3),
    "export": ("model.html", None, 1),
}


def site_column(dom: str, table_id: str) -> list[str]:
    """The "site" cell of every row of a table, as the browser holds it after the scripts ran."""
    match = re.search(rf'<table class="data" id="{table_id}">(.*?)</table>', dom, flags=re.S)
    assert match, f"no table {table_id} in the rendered page"
    head = re.findall(r"<th[^>]*>([^<]*)</th>", match.group(1))
    col = head.index("site")
    body = match.group(1).split("<tbody>", 1)[1]
    return [re.findall(r"<td[^>]*>([^<]*)</td>", row)[col]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, flags=re.S)]


@pytest.mark.parametrize("kind", list(PAGES))
def test_page_renders_every_site_and_its_figures(runs, kind, tmp_path):
    rel, expected, figures = PAGES[kind]
    page = runs / rel
    text = page.read_text()
    assert network_references(text) == [] and "<link" not in text
    assert text.count('id="qt-plotly"') == 1  # plotly.js inline, once
    dom = dump_dom(page, tmp_path)
    assert 'data-figures="drawn"' in dom, "plotly.js did not start"
    assert dom.count('class="main-svg"') >= 2 * figures  # each drawn figure: two SVG layers
    if expected is not None:
        shown = site_column(dom, "sites")
        assert sorted(shown) == sorted(expected(runs))
    assert pixel_std(screenshot(page, tmp_path)) > 0.02


def test_scan_page_flags_and_histograms_match_the_report(runs, tmp_path):
    report = ScanReport.load(runs / "activations")
    text = (runs / "activations" / "report.html").read_text()
    for row, why in report.problems():
        assert f"<code>{row.label}</code>: {'; '.join(why)}" in text.replace("&#x27;", "'")
    # one heatmap per measured point: weight, input and output SQNR are never pooled
    points = {r.point for r in report.rows}
    assert {"weight", "output"} <= points
    titles = {"weight": "weights", "input": "inputs (activations)", "output": "outputs (local error)"}
    for point in points:
        assert text.count(f"SQNR of the {titles[point]} by layer") == 1
    # the weight page's detail: every weight site with its weight and error histograms
    weights = (runs / "weights" / "report.html").read_text()
    detail = json.loads(re.search(r'id="detail\d+-data">(.*?)</script>', weights, re.S).group(1))
    assert sorted(detail) == sorted(weight_sites(runs))
    first = detail["model.layers.0.self_attn.q_proj"]
    names = [t["name"] for t in first["data"]]
    assert names == ["weight value", "quantization error (q - w)", "block exponent (power of two)"]
    q = next(r for r in ScanReport.load(runs / "weights").rows if r.site == "model.layers.0.self_attn.q_proj")
    assert sum(first["data"][2]["y"]) == q.block_exponents["blocks"]
    assert sum(first["data"][0]["y"]) == q.metrics["n"]  # 64x64 weights: under the sample size


def test_guide_and_export_pages_beside_their_files(runs):
    guide = (runs / "policy.html").read_text()
    assert '<a href="weights/report.html">the scan this policy comes from</a>' in guide
    policy = json.loads((runs / "policy.json").read_text())
    assert json.dumps(policy, indent=2).replace('"', "&quot;") in guide
    export = (runs / "model.html").read_text()
    assert export.count("weight_fake_quant") >= 14  # every inserted fake-quant module listed


def test_a_page_path_taken_by_a_folder_is_a_clear_error_before_any_work(runs, tmp_path):
    (tmp_path / "p.html").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "guide",
                           str(runs / "weights"), "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "p.html: is a folder" in proc.stderr and not (tmp_path / "p.json").exists()

