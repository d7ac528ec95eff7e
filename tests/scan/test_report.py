"""ScanReport files, problems, recommendations and the policies they carry; atomic writes."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import stat

import pytest
import torch

from qtransform.core import io as qio
from qtransform.core.metrics import ErrorStats
from qtransform.core.sites import Site
from qtransform.scan import render
from qtransform.scan.recommend import guide, layer_tiers, recommend
from qtransform.scan.render import FILES
from qtransform.scan.report import ScanReport, SiteRow, build_meta
from qtransform.schemas import load_policy, resolve_quant_rules

ROLES = ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")


def stats_at(sqnr_db: float, seed: int, n: int = 512) -> ErrorStats:
    """An accumulator whose SQNR is exactly `sqnr_db` (additive noise, no deadzone)."""
    g = torch.Generator().manual_seed(seed)
    x, e = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    e *= math.sqrt(float((x**2).sum() / (e**2).sum()) / 10 ** (sqnr_db / 10))
    return ErrorStats().update(x, x - e)


def make_report(layer_sqnr: list[float], lm_head: float | None = 25.0, fmt: str = "mxfp4") -> ScanReport:
    rows = []
    for layer, db in enumerate(layer_sqnr):
        for k, role in enumerate(ROLES):
            # one bad site is enough to make a layer problematic; the others are fine
            site_db = db if k == 2 else max(db, 25.0) + k
            rows.append(SiteRow.from_stats(
                f"model.layers.{layer}.{role}", "weight", stats_at(site_db, 100 * layer + k), layer=layer,
                role=role.rsplit(".", 1)[-1].split("_")[0], kind="linear", shape=[16, 32], fmt=fmt,
                options={"block_size": 32},
            ))
    if lm_head is not None:
        rows.append(SiteRow.from_stats("lm_head", "weight", stats_at(lm_head, 7), layer=None, role="lm_head",
                                       kind="linear", shape=[16, 32], fmt=fmt, options={}))
    meta = build_meta(kind="weight_scan", source="synthetic", fmt=fmt, options={"scale_rule": "floor"},
                      quantize=[{"name": "w", "targets": ["Linear"], "format": fmt}])
    return ScanReport(meta, rows, flagging="absolute")  # the recommender tests use fixed limits


def sites_of(report: ScanReport) -> list[Site]:
    return [Site(r.site, "Linear", "linear", r.layer, r.role) for r in report.rows]


def test_problems_follow_thresholds_and_can_be_overridden():
    report = make_report([30.0, 15.0])
    (row, why), = report.problems()
    assert row.site == "model.layers.1.mlp.down_proj"
    assert why[0].startswith("SQNR 15.00 dB < 20 dB") and why[1].startswith("rel_rmse 17.")
    assert report.problematic_layers() == [1]
    report.thresholds.update(sqnr_db=10.0, relative_error=0.2)
    assert report.problems() == []


def test_json_is_strict_versioned_and_round_trips(tmp_path):
    report = make_report([30.0, 15.0])
    zero = torch.zeros(8)
    report.rows.append(SiteRow.from_stats("exact", "weight", ErrorStats().update(torch.ones(8), torch.ones(8)),
                                          layer=None, role="other", kind="linear", shape=[8], fmt="mxfp4", options={}))
    report.rows.append(SiteRow.from_stats("zeros", "weight", ErrorStats().update(zero, zero), layer=None,
                                          role="other", kind="linear", shape=[8], fmt="mxfp4", options={}))
    text = render.report_json(report)  # what report.json holds: the data plus the recommendation
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (data["schema"], data["schema_version"]) == ("qtransform.scan_report", "1")
    assert data["rows"][-2]["metrics"]["sqnr_db"] == "inf" and data["rows"][-1]["metrics"]["sqnr_db"] == "nan"
    assert data["summary"]["problematic_layers"] == [1] and data["recommendation"]["kind"]
    paths = report.save(tmp_path / "out")
    again = ScanReport.load(tmp_path / "out")
    assert again.rows[-2].metrics["sqnr_db"] == math.inf and math.isnan(again.rows[-1].metrics["sqnr_db"])
    assert again.to_dict() == report.to_dict()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(FILES)  # no temp files left
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    data["schema_version"] = "2"
    with pytest.raises(ValueError, match="unsupported scan report version"):
        ScanReport.from_dict(data)


def test_csv_and_markdown():
    report = make_report([30.0, 15.0, 28.0])
    rows = list(csv.DictReader(io.StringIO(render.to_csv(report))))
    assert len(rows) == len(report.rows) and rows[0]["shape"] == "16x32"
    assert [r["site"] for r in rows if r["problematic"] == "1"] == ["model.layers.1.mlp.down_proj"]
    assert float(rows[0]["sqnr_db"]) == pytest.approx(report.rows[0].metrics["sqnr_db"], rel=1e-12)
    md = render.to_markdown(report)
    for part in ("## Recommendation", "## Layers", "## Sites", "```json", "problematic layers: 1",
                 "mean relative error is dominated by small values"):
        assert part in md


def test_few_problematic_layers_are_kept_in_high_precision():
    report = make_report([30.0] * 19 + [15.0])  # 1 of 20 layers: 5 %
    rec = recommend(report)
    assert rec.kind == "keep_high_precision" and rec.kept_layers == [19]
    assert rec.kept_sites == [f"model.layers.19.{r}" for r in ROLES]
    chosen = resolve_quant_rules(load_policy(rec.policy).quantize, sites_of(report))
    quantized = {name for name, _ in chosen}
    assert quantized.isdisjoint(rec.kept_sites) and "lm_head" in quantized
    assert len(quantized) == len(report.rows) - 3


def test_some_problematic_layers_get_high_precision_for_the_worst_and_aqn_for_the_rest():
    sqnr = [30.0 + 0.1 * i for i in range(20)]
    sqnr[3], sqnr[7], sqnr[11], sqnr[15] = 15.0, 16.0, 17.0, 18.0  # 4 of 20: 20 %
    report = make_report(sqnr, lm_head=12.0)  # a bad lm_head is kept too
    rec = recommend(report)
    assert rec.kind == "high_precision_and_aqn" and rec.kept_layers == [3, 7]
    assert "lm_head" in rec.kept_sites
    policy = load_policy(rec.policy)
    noise = policy.noise
    assert noise is not None and noise.layers == "0-2,4-6,8-19"
    assert noise.schedule.sigma_start == 0.01 and noise.schedule.sigma_end == 1e-4 and noise.schedule.stages == 10
    mult = noise.layer_multipliers
    assert set(mult) == set(range(20)) - {3, 7}
    assert mult[11] == mult[15] == 1.5 and mult[19] == 1.0  # worst tercile by layer SQNR gets 1.5
    assert sorted(mult.values()).count(1.5) == 6


def test_many_problematic_layers_suggest_a_finer_format_and_guide_can_force_aqn():
    report = make_report([15.0] * 8 + [30.0 + 0.5 * i for i in range(12)])  # 40 %
    rec = recommend(report)
    assert rec.kind == "change_format" and "mxfp8_e4m3" in rec.text
    assert [r.format for r in load_policy(rec.policy).quantize] == ["mxfp8_e4m3"]
    forced = load_policy(guide(report, tiers=(2.0, 1.0), aqn=True, total_steps=500))
    assert [r.format for r in forced.quantize] == ["mxfp4"]
    assert forced.noise is not None and forced.noise.schedule.total_steps == 500
    assert {k for k, v in forced.noise.layer_multipliers.items() if v == 2.0} == set(range(8)) | {8, 9}


def test_layer_tiers_split_by_rank():
    tiers = layer_tiers({i: float(10 - i) for i in range(9)})
    assert [tiers[i] for i in range(9)] == [1.0] * 3 + [1.2] * 3 + [1.5] * 3
    assert layer_tiers({0: math.nan, 1: 5.0}, (3.0, 1.0)) == {1: 3.0, 0: 1.0}
    with pytest.raises(ValueError, match="positive"):
        layer_tiers({0: 1.0}, (1.5, 0.0))


def test_atomic_writes_keep_the_old_file_on_error(tmp_path):
    target = tmp_path / "sub" / "a.json"
    qio.write_json(target, {"a": 1})
    with pytest.raises(RuntimeError), qio.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(target.parent) == ["a.json"]
    with pytest.raises(ValueError):
        qio.write_json(target, {"x": math.nan})  # strict JSON: encode NaN first
    mode = stat.S_IMODE(os.stat(qio.write_bytes(tmp_path / "b.bin", b"\x00")).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_without_layers_or_a_finer_format_the_problem_sites_are_kept():
    rec = recommend(make_report([], lm_head=12.0, fmt="int8"))
    assert rec.kind == "keep_high_precision" and rec.kept_sites == ["lm_head"]
    rec = recommend(make_report([15.0] * 8 + [30.0] * 12, fmt="int8"))
    assert rec.kind == "keep_high_precision" and rec.kept_layers == list(range(8))
    assert "no finer format" in rec.text
