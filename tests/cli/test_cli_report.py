"""`qtransform report A B ...` as a real process: runs side by side, deltas equal to the
difference of the results' own JSON, and one clear line for inputs that cannot be compared."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from qtransform.models import build_tiny
from qtransform.scan import scan_weights
from qtransform.scan.sensitivity import site_sensitivity
from tests.conftest import ids


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qtransform.cli.main", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def scans(tmp_path_factory):
    """Weight scans of one tiny model under mxfp4 and nvfp4, flagged against an absolute 20 dB:
    mxfp4's sites sit near 18.7 dB (flagged), nvfp4's near 20.3 dB (mostly not)."""
    root = tmp_path_factory.mktemp("scans")
    model = build_tiny("qwen2")
    for fmt in ("mxfp4", "nvfp4"):
        scan_weights(model, fmt, flagging="absolute").save(root / fmt)
    return root


def _rows(folder) -> dict[str, dict]:
    return {r["site"]: r for r in json.loads((folder / "report.json").read_text())["rows"]}


def test_two_formats_side_by_side_deltas_equal_the_json_difference(scans, tmp_path):
    out = tmp_path / "cmp"
    res = _cli("report", str(scans / "mxfp4"), str(scans / "nvfp4"), "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data == json.loads((out / "comparison.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["mxfp4", "nvfp4"] and data["kind"] == "scan"
    a, b = _rows(scans / "mxfp4"), _rows(scans / "nvfp4")
    assert [s["site"] for s in data["sites"]] == list(a)
    for entry in data["sites"]:
        site = entry["site"]
        for metric in ("sqnr_db", "rel_rmse", "deadzone", "saturation"):
            assert entry["deltas"][0][metric] == b[site]["metrics"][metric] - a[site]["metrics"][metric]
        d = entry["deltas"][0]["sqnr_db"]
        assert entry["changes"][0]["change"] == ("better" if d > 1.0 else "worse" if d < -1.0 else "")
        gone = [p for p in a[site]["problems"] if p not in b[site]["problems"]]
        assert entry["changes"][0]["flags_disappeared"] == gone
        assert entry["changes"][0]["flags_appeared"] == [p for p in b[site]["problems"]
                                                         if p not in a[site]["problems"]]
    assert sum(bool(e["changes"][0]["flags_disappeared"]) for e in data["sites"]) >= 10
    md = (out / "comparison.md").read_text()
    better = [e["site"] for e in data["sites"] if e["changes"][0]["change"] == "better"]
    assert f"- better: {len(better)}: " in md and better
    page = (out / "comparison.html").read_text()
    assert all(site in page for site in a) and "<script src" not in page


def test_threshold_and_labels(scans, tmp_path):
    res = _cli("report", str(scans / "mxfp4" / "report.json"), str(scans / "nvfp4"), "--out",
               str(tmp_path / "c"), "--json", "--threshold", "100", "--label", "A", "--label", "B")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [r["label"] for r in data["runs"]] == ["A", "B"]
    assert {e["changes"][0]["change"] for e in data["sites"]} == {""}


def test_sensitivity_runs_compare_scores_as_db(tmp_path):
    model = build_tiny("qwen2")
    for fmt in ("mxfp4", "nvfp4"):
        site_sensitivity(model, fmt, ids(2, 8)).save(tmp_path / fmt)
    res = _cli("report", str(tmp_path / "mxfp4"), str(tmp_path / "nvfp4"), "--out",
               str(tmp_path / "cmp"), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = [{r["site"]: r for r in json.loads((tmp_path / f / "sensitivity.json").read_text())["rows"]}
            for f in ("mxfp4", "nvfp4")]
    assert data["kind"] == "sensitivity" and len(data["sites"]) == len(rows[0])
    for entry in data["sites"]:
        a, b = rows[0][entry["site"]]["exact"], rows[1][entry["site"]]["exact"]
        assert entry["deltas"][0]["score_db"] == pytest.approx(10 * math.log10(b / a), rel=1e-12)
        assert entry["deltas"][0]["rank"] == rows[1][entry["site"]]["rank"] - rows[0][entry["site"]]["rank"]


def _one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_a_folder_that_is_not_a_result(scans, tmp_path):
    (tmp_path / "empty").mkdir()
    err = _one_line_error(_cli("report", str(scans / "mxfp4"), str(tmp_path / "empty"),
                               "--out", str(tmp_path / "o")))
    assert err.startswith(f"error: {tmp_path / 'empty'}: not a result folder")
    assert not (tmp_path / "o").exists()


def test_results_of_different_models_name_the_sites_that_differ(scans, tmp_path):
    scan_weights(build_tiny("qwen2", hidden=32), "mxfp4").save(tmp_path / "small")
    err = _one_line_error(_cli("report", str(scans / "mxfp4"), str(tmp_path / "small"),
                               "--out", str(tmp_path / "o")))
    assert "are results of different models" in err
    assert "model.layers.0.self_attn.q_proj is 64x64 in mxfp4 but 32x32 in small" in err


def test_mixed_result_kinds_cannot_be_compared(scans, tmp_path):
    site_sensitivity(build_tiny("qwen2"), "mxfp4", ids(2, 8)).save(tmp_path / "sens")
    err = _one_line_error(_cli("report", str(scans / "mxfp4"), str(tmp_path / "sens"),
                               "--out", str(tmp_path / "o")))
    assert "cannot be compared" in err and "is a scan result" in err and "is a sensitivity result" in err


def test_a_run_against_itself_changes_nothing(scans):
    from qtransform import compare_runs

    result = compare_runs([scans / "mxfp4", scans / "mxfp4" / "report.json"])
    data = result.to_dict()
    assert [r["label"] for r in data["runs"]] == ["mxfp4#1", "mxfp4#2"]
    assert all(v == 0.0 for e in data["sites"] for v in e["deltas"][0].values())
    assert all(e["changes"][0] == {"change": "", "flags_appeared": [], "flags_disappeared": []}
               for e in data["sites"])


def test_a_folder_of_results_names_its_result_subfolders(scans, tmp_path):
    from qtransform import compare_runs
    from qtransform.errors import UserError

    with pytest.raises(UserError, match=r"its subfolders mxfp4, nvfp4 are \(give one of them\)"):
        compare_runs([scans, scans / "nvfp4"])


def test_sensitivity_of_different_models_names_the_sites(tmp_path):
    from qtransform import compare_runs
    from qtransform.errors import UserError

    site_sensitivity(build_tiny("qwen2"), "mxfp4", ids(2, 8)).save(tmp_path / "big")
    site_sensitivity(build_tiny("qwen2", hidden=32), "mxfp4", ids(2, 8)).save(tmp_path / "small")
    with pytest.raises(UserError, match=r"big and small are results of different models: "
                                        r"model\.layers\.0\.self_attn\.v_proj is 2048 weights in big but 512 weights in small"):
        compare_runs([tmp_path / "big", tmp_path / "small"])


def test_bad_options_are_one_clear_error(scans, tmp_path):
    from qtransform import compare_runs
    from qtransform.errors import UserError

    with pytest.raises(UserError, match=r"give one distinct label per result folder"):
        compare_runs([scans / "mxfp4", scans / "nvfp4"], labels=["a"])
    with pytest.raises(UserError, match=r"give at least two result folders"):
        compare_runs([scans / "mxfp4"])
    with pytest.raises(UserError, match=r"threshold -1: give a non-negative number of dB"):
        compare_runs([scans / "mxfp4", scans / "nvfp4"], threshold_db=-1)
    with pytest.raises(UserError, match=r"no such result folder or file"):
        compare_runs([scans / "mxfp4", tmp_path / "missing"])
