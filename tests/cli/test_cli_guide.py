"""`qtransform guide`: a damaged report is the user's problem (exit 2, one line), a bug in
qtransform is an internal error (exit 3, its traceback, a request to report it), never "re-run
the scan"."""

from __future__ import annotations

import json
import sys

import pytest

from qtransform.cli.main import main
from qtransform.models import build_tiny
from qtransform.scan import scan_weights
from qtransform.scan.recommend import recommend
from tests.scan import test_kv_remedy as kv


@pytest.fixture
def scanned(tmp_path):
    scan_weights(build_tiny("qwen2"), "mxfp4").save(tmp_path / "scan")
    return tmp_path / "scan"


@pytest.mark.parametrize("damage", ["threshold", "rule"])
def test_a_damaged_report_is_a_user_error(scanned, tmp_path, capsys, damage):
    path = scanned / "report.json"
    data = json.loads(path.read_text())
    if damage == "threshold":
        data["thresholds"]["sqnr_margin_db"] = "three"  # loads, fails only where flags are computed
    else:
        data["meta"]["quantize"][0]["format"] = "mxfp9"  # a rule no policy accepts
    path.write_text(json.dumps(data))
    assert main(["guide", str(scanned), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: not a scan report"), err
    assert not (tmp_path / "p.json").exists()


def test_a_bug_in_guide_is_an_internal_error(scanned, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(sys.modules["qtransform.cli.scan"], "guide", broken)  # the name the CLI calls
    assert main(["guide", str(scanned), "--out", str(tmp_path / "p.json")]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("internal error: TypeError in qtransform itself")
    assert "re-run" not in err and not (tmp_path / "p.json").exists()
    with pytest.raises(TypeError):  # --debug: the exception itself, as for user errors
        main(["--debug", "guide", str(scanned), "--out", str(tmp_path / "p.json")])


@pytest.mark.parametrize("damage", ["not json", "params", "batch size"])
def test_a_damaged_sensitivity_file_is_a_user_error(scanned, tmp_path, capsys, damage):
    from qtransform.scan.sensitivity import site_sensitivity
    from tests.conftest import ids

    sens = tmp_path / "sens"
    site_sensitivity(build_tiny("qwen2"), "mxfp4", ids(2, 8)).save(sens)
    path = sens / "sensitivity.json"
    data = json.loads(path.read_text())
    if damage == "not json":
        path.write_text(path.read_text()[:100])
    else:
        if damage == "params":
            data["rows"][3]["params"] = "many"
        else:
            data["meta"]["calibration"]["batch_size"] = "eight"
        path.write_text(json.dumps(data))
    argv = ["guide", str(scanned), "--out", str(tmp_path / "p.json"), "--keep", "2",
            "--sensitivity", str(sens), "--model", "builtin:qwen2", "--calib", "builtin"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: not a sensitivity report"), err


def test_guide_names_the_kv_scales_that_clear_flagged_kv_rows(tmp_path, capsys):
    """`qtransform guide` on a saved report: the policy file is the recommendation's, and the
    terminal and the guide page say which KV scales clear the rows and what they cost; report.md
    shows the rungs."""
    report = kv.scanned(kv.head_model(), [kv.LINEAR, kv.KV], kv.batch())
    report.save(tmp_path / "scan")
    assert "## KV-cache alternatives" in (tmp_path / "scan" / "report.md").read_text()
    assert main(["guide", str(tmp_path / "scan"), "--out", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err  # the advice goes to stderr, the policy to the file
    assert "fp8_e4m3 per head, static minmax clears 2 flagged key/value rows" in err
    assert "attn_head" in err and "attn_head" in (tmp_path / "p.html").read_text()
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["quantize"][1]["granularity"] == "head"
    assert written == recommend(report).policy
