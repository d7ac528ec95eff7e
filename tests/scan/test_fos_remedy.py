"""Four over six as the remedy for NVFP4 weights (scan/fos_remedy.py): the quantizer's own max/4
choice (`four_over_six_blocks`), measured by the weight scan and `compare`, proposed by
`recommend`/`guide` where it clears flagged sites, on a tiny Qwen2 with a planted site whose
blocks hold values near 3/4 of their max (exact on the max/4 grid, mid-gap on max/6's).
Expected values come from `fake_quantize` with the option and float64 metrics; the max/4 count
from the blocks where four over six's output differs from plain NVFP4's (a block keeps max/6
exactly when its output is plain NVFP4's, and max/4 only when that lowers its error)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.errors import UserError
from qtransform.formats import fake_quantize
from qtransform.formats.quantize import four_over_six_blocks
from qtransform.models import build_tiny
from qtransform.scan import compare_formats, guide, recommend, scan_weights
from qtransform.scan.report import ScanReport
from tests.helpers import assert_metrics, metrics_f64

PLANTED = "model.layers.1.mlp.down_proj"
OUTLIER_SITE = "model.layers.0.mlp.up_proj"
OUTLIERS = [3, 17, 40, 50]  # input channels of the outlier site, 40x the others
LABEL = "four_over_six=mse"


def three_quarters(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Blocks of 16 whose first value is the block max m and the others about 0.75 m."""
    g = torch.Generator().manual_seed(seed)
    out, inn = shape
    m = torch.rand(out, inn // 16, 1, generator=g) * 0.1 + 0.02
    v = (0.75 + 0.02 * torch.randn(out, inn // 16, 16, generator=g)) * m
    v[..., 0] = m[..., 0]
    sign = torch.where(torch.rand(out, inn // 16, 16, generator=g) < 0.5, -1.0, 1.0)
    return (v * sign).reshape(out, inn)


def planted(outliers: bool = False) -> torch.nn.Module:
    """12 layers, so that one flagged layer is under 10 % (kept, not a format change)."""
    model = build_tiny("qwen2", num_layers=12, hidden=64)
    with torch.no_grad():
        w = model.get_submodule(PLANTED).weight
        w.copy_(three_quarters(tuple(w.shape)))
        if outliers:
            model.get_submodule(OUTLIER_SITE).weight[:, OUTLIERS] *= 40
    return model


def changed_blocks(x: torch.Tensor, axis: int = -1, **options) -> torch.Tensor:
    """Per block along `axis`: whether four over six's output differs from plain NVFP4's."""
    plain = {k: v for k, v in options.items() if k not in ("four_over_six", "four_over_six_order")}
    a = fake_quantize(x, "nvfp4", axis=axis, **options).float()
    b = fake_quantize(x, "nvfp4", axis=axis, **plain).float()
    d = (a != b) & ~(a.isnan() & b.isnan())
    d = d.movedim(axis, -1)
    d = torch.nn.functional.pad(d, (0, (-d.shape[-1]) % 16))
    return d.reshape(*d.shape[:-1], -1, 16).any(-1).movedim(-1, axis)


@pytest.mark.parametrize("options", [
    {"four_over_six": "mse"}, {"four_over_six": "mae"}, {"four_over_six": "mse", "axis": 0},
    {"four_over_six": "mse", "global_bound": "256"},
    {"four_over_six": "mse", "four_over_six_order": "transformer-engine"},
    {"four_over_six": "mse", "rounding": "stochastic", "seed": 3},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max4_blocks_are_the_quantizers_choice(options, dtype):
    x = torch.cat([torch.randn(40, 72), three_quarters((40, 80))[:, :72]]).to(dtype)  # ragged rows
    options = dict(options)
    axis = options.pop("axis", -1)
    mask = four_over_six_blocks(x, "nvfp4", axis=axis, **options)
    want = changed_blocks(x, axis, **options)
    assert mask.shape == want.shape and mask.dtype == torch.bool
    assert torch.equal(mask, want) and 0 < int(mask.sum()) < mask.numel()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=16, max_size=80),
       st.sampled_from(["mse", "mae"]))
def test_max4_blocks_match_the_outputs_on_any_row(values, mode):
    x = torch.tensor(values, dtype=torch.float32)[None]
    assert torch.equal(four_over_six_blocks(x, "nvfp4", four_over_six=mode),
                       changed_blocks(x, four_over_six=mode))


def test_max4_blocks_takes_a_given_amax():
    x = three_quarters((8, 64))
    amax = torch.tensor(3.0)
    assert torch.equal(four_over_six_blocks(x, "nvfp4", four_over_six="mse", amax=amax),
                       changed_blocks(x, four_over_six="mse", amax=amax))


def test_max4_blocks_refuses_formats_without_the_choice():
    with pytest.raises(ValueError, match="four_over_six 'mse' or 'mae'"):
        four_over_six_blocks(torch.randn(4, 32), "nvfp4")
    with pytest.raises(ValueError, match="four_over_six 'mse' or 'mae'"):
        four_over_six_blocks(torch.randn(4, 32), "mxfp4")


def test_scan_measures_four_over_six_on_every_nvfp4_weight():
    model = planted()
    report = scan_weights(model, "nvfp4", four_over_six=("mse", "mae"))
    for row in report.rows:
        w = model.get_submodule(row.site).weight.detach()
        plain = fake_quantize(w, "nvfp4")
        assert_metrics(row.metrics, metrics_f64(w, plain))
        for mode in ("mse", "mae"):
            found = row.remedies[f"four_over_six={mode}"]
            assert_metrics(found["metrics"], metrics_f64(w, fake_quantize(w, "nvfp4", four_over_six=mode)))
            count = changed_blocks(w, four_over_six=mode)
            assert (found["max4_blocks"], found["blocks"]) == (int(count.sum()), count.numel())
            assert found["max4_share"] == int(count.sum()) / count.numel()
            assert found["fields"] == {"four_over_six": mode} and found["rule"] == 0
    planted_row = next(r for r in report.rows if r.site == PLANTED)
    assert planted_row.remedies[LABEL]["max4_share"] > 0.8  # near 3/4 of the max: max/4 wins
    assert planted_row.remedies[LABEL]["metrics"]["sqnr_db"] > planted_row.metrics["sqnr_db"] + 3


def test_scans_measure_it_only_where_the_option_applies():
    model = build_tiny("qwen2", hidden=64)
    for fmt, options in [("mxfp4", None), ("nvfp4", {"nvfp4_variant": "modelopt"}),
                         ("nvfp4", {"four_over_six": "mse"})]:
        report = scan_weights(model, fmt, options=options)
        assert all(r.remedies is None for r in report.rows)
    assert all(r.remedies is None for r in scan_weights(model, "nvfp4", four_over_six=()).rows)
    with pytest.raises(UserError, match="'mse' and/or 'mae'"):
        scan_weights(model, "nvfp4", four_over_six="mse")


def test_a_four_over_six_scan_reports_its_max4_share():
    model = planted()
    report = scan_weights(model, "nvfp4", options={"four_over_six": "mse"})
    row = next(r for r in report.rows if r.site == PLANTED)
    count = changed_blocks(model.get_submodule(PLANTED).weight.detach(), four_over_six="mse")
    assert row.diagnostics["max4_blocks"] == int(count.sum())
    assert row.diagnostics["max4_share"] == int(count.sum()) / count.numel()


def test_remedies_survive_save_and_load(tmp_path):
    report = scan_weights(planted(), "nvfp4")
    report.save(tmp_path)
    again = ScanReport.load(tmp_path)
    assert [r.remedies for r in again.rows] == [r.remedies for r in report.rows]
    assert recommend(again).to_dict() == recommend(report).to_dict()
    md = (tmp_path / "report.md").read_text()
    assert "## Four over six beside NVFP4" in md
    section = md.split("## Four over six beside NVFP4")[1]
    line = next(ln for ln in section.splitlines() if ln.startswith(f"| {PLANTED} |"))
    assert line.endswith("| yes | yes |")


def test_recommend_proposes_four_over_six_where_it_clears():
    model = planted()
    report = scan_weights(model, "nvfp4")
    assert [r.site for r, _ in report.problems()] == [PLANTED]
    without = recommend(scan_weights(model, "nvfp4", four_over_six=()))
    assert without.kind == "keep_high_precision" and PLANTED in without.kept_sites
    rec = recommend(report)
    assert rec.kind == "four_over_six" and rec.kept_sites == []
    assert rec.policy["quantize"] == [{"name": "weights", "targets": ["Linear"], "format": "nvfp4",
                                       "block_size": 16, "rounding": "rne", "nvfp4_variant": "default",
                                       "four_over_six": "mse"}]
    share = next(r for r in report.rows if r.site == PLANTED).remedies[LABEL]["max4_share"]
    assert rec.four_over_six == {"alternative": LABEL, "mode": "mse", "rules": [0], "rows": [PLANTED],
                                 "max4_share": {PLANTED: share}}
    assert "no storage bit" in rec.text and "Transformer Engine" in rec.text
    assert f"max/4 in {100 * share:.0f} % of blocks" in rec.text


def test_four_over_six_and_high_precision_combine():
    """An outlier-channel site four over six cannot clear (its blocks lose their small values to
    zero either way) stays in high precision beside the planted site it clears."""
    model = planted(outliers=True)
    report = scan_weights(model, "nvfp4")
    assert {r.site for r, _ in report.problems()} == {PLANTED, OUTLIER_SITE}
    rec = recommend(report)
    assert rec.kind == "keep_high_precision" and rec.four_over_six["rows"] == [PLANTED]
    assert OUTLIER_SITE in rec.kept_sites and PLANTED not in rec.kept_sites
    rule = rec.policy["quantize"][0]
    assert rule["four_over_six"] == "mse" and OUTLIER_SITE in rule["ignore"]
    assert rec.text.startswith("Four over six (mse) clears 1 flagged NVFP4 site")


def test_no_four_over_six_where_nothing_is_flagged_or_nothing_clears():
    gaussian = scan_weights(build_tiny("qwen2", hidden=64), "nvfp4")
    assert gaussian.problems() == []
    rec = recommend(gaussian)
    assert rec.four_over_six is None and "four_over_six" not in rec.policy["quantize"][0]
    strict = scan_weights(build_tiny("qwen2", hidden=64), "nvfp4", flagging="absolute",
                          thresholds={"sqnr_db": 30.0})  # four over six gains about 0.8 dB here
    assert len(strict.problems()) == len(strict.rows)
    rec = recommend(strict)
    assert rec.four_over_six is None and rec.kind == "change_format"


def test_the_policy_quantizes_the_planted_site_with_four_over_six():
    from qtransform import transform

    model = planted()
    policy = guide(scan_weights(model, "nvfp4"))
    out = transform(model, policy)
    weight = model.get_submodule(PLANTED).weight.detach()
    with torch.no_grad():
        w_eff = out.get_submodule(PLANTED)(torch.eye(weight.shape[1])).T
    assert torch.equal(w_eff, fake_quantize(weight, "nvfp4", four_over_six="mse"))
    assert not torch.equal(w_eff, fake_quantize(weight, "nvfp4"))


def test_compare_puts_four_over_six_beside_nvfp4():
    model = planted()
    comparison = compare_formats(model, ["nvfp4", "nvfp4:four_over_six=mse"])
    assert comparison.formats == ["nvfp4", "nvfp4:four_over_six=mse"]
    fos = comparison.reports["nvfp4:four_over_six=mse"]
    assert fos.meta["format"] == "nvfp4" and fos.meta["options"]["four_over_six"] == "mse"
    chosen = blocks = 0
    for row in fos.rows:
        count = changed_blocks(model.get_submodule(row.site).weight.detach(), four_over_six="mse")
        assert row.diagnostics["max4_blocks"] == int(count.sum())
        chosen, blocks = chosen + int(count.sum()), blocks + count.numel()
    assert comparison.totals["nvfp4:four_over_six=mse"]["max4_share"] == chosen / blocks
    assert "max4_share" not in comparison.totals["nvfp4"]
    assert f"| max/4 blocks | - | {100 * chosen / blocks:.1f} % | |" in comparison.markdown()
    with pytest.raises(UserError, match="FORMAT:OPTION=VALUE"):
        compare_formats(model, ["nvfp4:four_over_six"])


def test_compare_and_guide_cli(tmp_path, capsys):
    from qtransform.cli.main import main

    model_dir = tmp_path / "model"
    planted().save_pretrained(model_dir)
    assert main(["compare", str(model_dir), "--formats", "nvfp4,nvfp4:four_over_six=mse",
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "| metric | nvfp4 | nvfp4:four_over_six=mse | better |" in out and "| max/4 blocks | - |" in out
    data = json.loads((tmp_path / "c" / "comparison.json").read_text())
    assert 0 < data["totals"]["nvfp4:four_over_six=mse"]["max4_share"] < 1
    assert "max/4 blocks %" in (tmp_path / "c" / "comparison.html").read_text()
    assert main(["scan", str(model_dir), "--format", "nvfp4", "--out", str(tmp_path / "scan")]) == 0
    assert "Four over six (mse) clears 1 flagged NVFP4 site" in capsys.readouterr().out
    assert "Four over six beside NVFP4" in (tmp_path / "scan" / "report.html").read_text()
    assert main(["guide", str(tmp_path / "scan"), "--out", str(tmp_path / "policy.json")]) == 0
    assert json.loads((tmp_path / "policy.json").read_text())["quantize"][0]["four_over_six"] == "mse"
    assert "no storage bit" in capsys.readouterr().err
    assert main(["scan", str(model_dir), "--format", "nvfp4", "--four-over-six-remedy", "none",
                 "--out", str(tmp_path / "plain")]) == 0
    assert "keep" in capsys.readouterr().out
    assert main(["scan", str(model_dir), "--format", "nvfp4", "--four-over-six-remedy", "max",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "mse, mae, mse,mae or none" in capsys.readouterr().err
