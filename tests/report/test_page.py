"""The page builder: one self-contained file, tables that sort and filter, figures by Plotly."""

from __future__ import annotations

import base64
import gzip
import math
import re
from pathlib import Path

import plotly.graph_objects as go
from hypothesis import given
from hypothesis import strategies as st

from qtransform.report.page import Page
from tests.report.browser import dump_dom, pixel_std, screenshot


def network_references(text: str) -> list[str]:
    """Every tag attribute that would make a browser fetch from the network."""
    return re.findall(r"<(?:script|link|img|iframe|source|embed)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//[^>]*>",
                      text, flags=re.I)


def sample_page() -> Page:
    page = Page("Sample <report>", {"model": "tiny", "seed": 3, "options": {"block": 32}})
    page.section("Overview", "Two sites & a flag.")
    page.heatmap([0, 1], ["q_proj", "k_proj"], [[30.0, 12.0], [29.0, None]], "SQNR", "dB")
    page.table([{"site": "model.layers.0.q_proj", "sqnr_db": 30.0, "n": 4096},
                {"site": "model.layers.1.q_proj", "sqnr_db": 12.0, "n": 4096},
                {"site": "model.layers.0.k_proj", "sqnr_db": math.inf, "n": 7}],
               id="sites", flagged=[False, True, False])
    page.flags([("model.layers.1.q_proj", "SQNR 12.00 dB is below the expected 18 dB minus 3 dB")])
    page.detail("Per-site detail", {"model.layers.0.q_proj": go.Figure(go.Bar(x=[1, 2], y=[3, 4]))})
    page.link("the weight scan", "../weights/report.html")
    return page


def test_page_is_one_offline_file_with_plotly_inline_once(tmp_path):
    path = sample_page().write(tmp_path / "page.html")
    text = path.read_text()
    assert network_references(text) == []
    assert "<link" not in text and "<script src" not in text
    bundle = re.findall(r'<script type="application/octet-stream" id="qt-plotly">([^<]*)</script>', text)
    assert len(bundle) == 1
    js = gzip.decompress(base64.b64decode(bundle[0])).decode()
    assert "plotly.js" in js[:400] and len(js) > 3_000_000
    assert "Sample &lt;report&gt;" in text and "Two sites &amp; a flag." in text
    assert 'data-v="Infinity"' in text and '<tr class=flagged>' in text
    assert '<a href="../weights/report.html">the weight scan</a>' in text
    assert "block=32" in text


def test_a_page_without_figures_carries_no_plotly(tmp_path):
    page = Page("tables only", {})
    page.table([{"a": 1}])
    assert "qt-plotly" not in page.html().split("<script>")[0]
    assert len(page.html()) < 20_000


@given(st.text(max_size=40))
def test_no_text_can_close_a_script_or_open_a_tag(text):
    page = Page(text, {text: text})
    page.section(text, text).table([{text: text}]).flags([(text, text)]).link(text, text)
    page.figure(go.Figure(go.Bar(x=[text], y=[1])))
    body = page.html()
    # the only tags are the builder's: a user string never adds a <script> or closes one
    assert body.count("<script") == 3 and body.count("</script>") == 3


def test_chromium_draws_the_figures_and_keeps_every_row(tmp_path):
    path = sample_page().write(tmp_path / "page.html")
    dom = dump_dom(path, tmp_path)
    assert 'data-figures="drawn"' in dom
    assert dom.count('class="main-svg"') >= 4  # heatmap and detail figure, two SVG layers each
    rows = re.findall(r"<tr[^>]*>\s*<td>(model\.layers\.[^<]*)</td>", dom)
    assert sorted(rows) == ["model.layers.0.k_proj", "model.layers.0.q_proj", "model.layers.1.q_proj"]
    assert pixel_std(screenshot(path, tmp_path)) > 0.02


def test_sorting_and_filtering_run_in_chromium(tmp_path):
    """The page's own scripts, driven in the browser: sort a numeric column twice, then filter."""
    page = Page("sort and filter", {})
    page.table([{"site": f"s{i}", "v": v} for i, v in enumerate([3.0, -1.0, math.nan, 10.0, 2.5])],
               id="t")
    drive = ("<script>const th=document.querySelectorAll('#t th')[1];qtSort(th);"
             "document.body.dataset.asc=[...document.querySelectorAll('#t tbody tr')]"
             ".map(r=>r.cells[0].textContent).join(',');qtSort(th);"
             "document.body.dataset.desc=[...document.querySelectorAll('#t tbody tr')]"
             ".map(r=>r.cells[0].textContent).join(',');const f=document.querySelector('input.filter');"
             "f.value='S3';qtFilter(f);</script></body>")
    path = tmp_path / "page.html"
    path.write_text(page.html().replace("</body>", drive))
    dom = dump_dom(path, tmp_path)
    assert 'data-asc="s1,s4,s0,s3,s2"' in dom  # numbers as numbers, n/a last
    assert 'data-desc="s2,s3,s0,s4,s1"' in dom
    shown = re.findall(r'<tr( style="[^"]*")?><td>(s\d)</td>', dom)
    assert [s for style, s in shown if "none" not in style] == ["s3"]
    assert ">1 shown<" in dom


def test_ci_installs_chromium_before_the_tests_and_stops_when_it_cannot():
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    install = ci.index("apt-get install -y -q chromium")
    assert install < ci.index("&& pytest") and "exit 1" in ci[install:ci.index("&& pytest")]
