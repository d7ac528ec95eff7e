"""SIGTERM and SIGINT in the middle of a run: the process exits 128 + signal with one line, the
previous output is exactly as it was, and no temporary file, staging folder or lock is left.

Real `python -m qtransform.cli.main` processes; the signal is sent once the run holds its output
lock (its checks passed and the work has started)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.robustness.conftest import REPO, W4A16, snapshot


def start(*argv: str | Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "qtransform.cli.main", *map(str, argv)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(folder: Path, prefix: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(p.name.startswith(prefix) for p in folder.iterdir()):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the run never started its work"
        time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_export_keeps_the_old_file_and_leaves_nothing(tmp_path, sig):
    out = tmp_path / "q.onnx"
    out.write_bytes(b"the previous export")
    before = snapshot(tmp_path)
    proc = start("export", "builtin:qwen2", "--policy", W4A16, "--out", out, "--seq-len", "32")
    wait_for(tmp_path, ".q.onnx.lock", proc)
    time.sleep(0.5)  # inside the export now
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 128 + sig, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert snapshot(tmp_path) == before  # old bytes, no .tmp file, no lock


def test_sigint_during_transform_keeps_the_previous_output_whole(cli, tmp_path, models):
    out = tmp_path / "out"
    first = cli("transform", models["qwen2"], W4A16, "--out", out)
    assert first.rc == 0, first.stderr
    before = snapshot(tmp_path)
    proc = start("transform", models["gpt2"], W4A16, "--out", out)
    wait_for(tmp_path, ".out.tmp-", proc)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 130, err  # staging exists from the checks until the swap: still working
    assert snapshot(tmp_path) == before  # the qwen2 output, every file of it, and nothing else
