"""`qtransform export` as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from qtransform.cli.main import main
from tests.conftest import REPO

W4A16 = REPO / "schemas" / "examples" / "w4a16_mxfp4.json"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "qtransform.cli.main", "export", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def test_export_a_builtin_model(tmp_path):
    out = tmp_path / "qwen2.onnx"
    res = cli("builtin:qwen2", "--policy", str(W4A16), "--out", str(out), "--seq-len", "8", "--batch", "2",
              "--static", "--noise", "off", "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["out"] == str(out) and summary["fake_quant_nodes"] == 14
    assert summary["inputs"] == ["input_ids"] and summary["outputs"] == ["logits"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input_ids": np.zeros((2, 8), np.int64)})[0]
    assert logits.shape == (2, 8, 256) and np.isfinite(logits).all()


def test_a_user_mistake_exits_2_without_a_traceback(tmp_path):
    res = cli("builtin:qwen2", "--policy", str(tmp_path / "nope.json"), "--out", str(tmp_path / "m.onnx"))
    assert res.returncode == 2 and "error:" in res.stderr and "Traceback" not in res.stderr


def test_more_mistakes_and_help(tmp_path, capsys):
    out = str(tmp_path / "m.onnx")
    assert main(["export", "builtin:qwen3", "--policy", str(W4A16), "--out", out]) == 2
    assert "unknown built-in model 'qwen3'" in capsys.readouterr().err
    assert main(["export", "builtin:qwen2", "--policy", str(W4A16), "--out", out, "--seq-len", "999"]) == 2
    assert "max_position_embeddings (256)" in capsys.readouterr().err
    for bad in (["--fake-quant", "qdk"], ["--seq-len", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(["export", "builtin:qwen2", "--policy", str(W4A16), "--out", out, *bad])
        assert exit_.value.code == 2
    assert "invalid choice: 'qdk'" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = capsys.readouterr().out
    assert "qtransform export builtin:qwen2 --policy" in text and "--fake-quant" in text
