"""One story per run: tables never pool point kinds (weight, input, output) into one column, and
recommendations follow a sensitivity measurement where one exists (docs/reports.md)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qtransform.cli.scan import scan_table
from qtransform.models import build_tiny
from qtransform.scan import (
    ScanReport,
    SensitivityReport,
    guide,
    recommend,
    scan_weights,
    site_sensitivity,
)
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


def _disagreeing_model() -> torch.nn.Module:
    model = build_tiny("qwen2", num_layers=12)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.v_proj.weight[:, 3] *= 100.0
        attn.o_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def disagreeing(tmp_path_factory):
    """12 layers (one bad layer is under 10 %: keep it). Layer 0's v_proj gets an outlier input
    channel (the weight scan flags its deadzone) while layer 0's o_proj is zero, so nothing v_proj
    computes reaches the output: its exact sensitivity is 0 by construction."""
    model = _disagreeing_model()
    root = tmp_path_factory.mktemp("run")
    scan_weights(model, "mxfp4").save(root)
    site_sensitivity(model, "mxfp4", ids(2, 8)).save(root)  # the same folder: one run
    return root


V0 = "model.layers.0.self_attn.v_proj"


def test_recommendation_follows_sensitivity_and_says_where_the_views_disagree(disagreeing):
    report = ScanReport.load(disagreeing)
    sens = SensitivityReport.load(disagreeing)
    assert [row.site for row, _ in report.problems()] == [V0]
    by_error = recommend(report)
    assert by_error.kind == "keep_high_precision" and V0 in by_error.kept_sites
    rec = recommend(report, sensitivity=sens)
    top = [r.site for r in sens.ranked()[:len(by_error.kept_sites)]]
    assert rec.kept_sites == top and V0 not in rec.kept_sites and rec.ranking == "exact"
    rank = next(r.rank for r in sens.rows if r.site == V0)
    # nothing reaches the logits through the zeroed o_proj: a KL of float64 rounding alone
    assert sens.rows[0].exact > 1e-6 and abs(next(r.exact for r in sens.rows if r.site == V0)) < 1e-12
    assert rank >= len(sens.rows) - 1  # last, tied with the zero o_proj
    note = (f"weight scan flags {V0} for deadzone, but exact sensitivity ranks it "
            f"{rank}{'rd' if rank % 10 == 3 and rank % 100 != 13 else 'th'} of {len(sens.rows)}: "
            "keeping it in high precision buys little")
    assert rec.disagreements[0] == note and note in rec.text
    assert rec.policy["quantize"][0]["ignore"] == top
    assert guide(report, sensitivity=sens) == rec.policy


def test_guide_cli_reads_the_sensitivity_of_the_same_folder(disagreeing, tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "guide", str(disagreeing),
                          "--out", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    sens = SensitivityReport.load(disagreeing)
    want = recommend(ScanReport.load(disagreeing), sensitivity=sens)
    assert json.loads((tmp_path / "p.json").read_text()) == want.policy
    assert f"sites ranked by the sensitivity in {disagreeing / 'sensitivity.json'}" in res.stderr
    assert f"weight scan flags {V0} for deadzone" in res.stderr


def test_nothing_flagged_keeps_nothing_and_names_the_most_sensitive_site():
    model = build_tiny("qwen2")
    report = scan_weights(model, "mxfp4")
    sens = site_sensitivity(model, "mxfp4", ids(2, 8))
    assert not report.problems()
    rec = recommend(report, sensitivity=sens)
    assert rec.kept_sites == [] and rec.policy == recommend(report).policy
    assert rec.text.endswith(f"The exact sensitivity ranks {sens.ranked()[0].site} first of "
                             f"{len(sens.rows)}: the site to keep if one must be.")


def test_a_flagged_site_the_sensitivity_did_not_measure_stays_kept(disagreeing):
    report = ScanReport.load(disagreeing)
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head", V0],
                                          "format": "mxfp4"}]}
    sens = site_sensitivity(_disagreeing_model(), policy, ids(2, 8))
    rec = recommend(report, sensitivity=sens)
    count = len(recommend(report).kept_sites) - 1
    assert rec.kept_sites == [r.site for r in sens.ranked()[:count]] + [V0]
    assert f"the sensitivity did not measure {V0}: kept by weight error" in rec.disagreements
