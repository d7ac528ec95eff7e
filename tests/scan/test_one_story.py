"""One story per run: tables never pool point kinds (weight, input, output) into one column, and
recommendations follow a sensitivity measurement where one exists (docs/reports.md)."""

from __future__ import annotations

import math

import pytest

from qtransform.cli.scan import scan_table
from qtransform.models import build_tiny
from qtransform.scan.activations import scan_activations
from qtransform.scan.render import format_metric, to_markdown
from tests.conftest import ids


@pytest.fixture(scope="module")
def activation_report():
    return scan_activations(build_tiny("qwen2"), "mxfp4", ids(2, 8), batch_size=2, token_stride=1)


def _layer_rows(markdown: str) -> list[list[str]]:
    section = markdown.split("## Layers", 1)[1].split("## Sites", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row] for row in rows]


def test_layer_table_gives_each_point_kind_its_own_row(activation_report):
    report = activation_report
    assert report.points() == ["weight", "output"]  # W4A16: outputs carry local error
    head, *body = _layer_rows(to_markdown(report))
    assert head[:4] == ["layer", "point", "sites", "SQNR dB"]
    assert len(body) == len(report.layers()) * 2
    for layer, point, _sites, sqnr, worst, *_ in body:
        mine = [r for r in report.rows if r.layer == int(layer) and r.point == point]
        # the merged errors of this point kind only: a pooled table (all points of the layer)
        # would show another number
        assert sqnr == format_metric("sqnr_db", report.aggregate(mine)["sqnr_db"])
        assert worst == min(mine, key=lambda r: r.metrics["sqnr_db"]).site
    pooled = report.aggregate([r for r in report.rows if r.layer == 0])["sqnr_db"]
    weights = report.aggregate([r for r in report.rows if r.layer == 0 and r.point == "weight"])["sqnr_db"]
    assert format_metric("sqnr_db", pooled) != format_metric("sqnr_db", weights)  # told apart
    assert not math.isnan(weights)


def test_whole_model_line_and_terminal_table_split_point_kinds(activation_report):
    report = activation_report
    md = to_markdown(report)
    for point in ("weight", "output"):
        total = report.aggregate([r for r in report.rows if r.point == point])["sqnr_db"]
        assert f"- whole model, {point} points: sqnr_db {format_metric('sqnr_db', total)}," in md
    lines = scan_table(report).splitlines()
    weight0 = next(line.split() for line in lines if line.split()[:2] == ["0", "weight"])
    want = report.aggregate([r for r in report.rows if r.layer == 0 and r.point == "weight"])["sqnr_db"]
    assert weight0[3] == format_metric("sqnr_db", want)
