"""Output targets: what may be replaced, what never is, permissions, locks, the manifest."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from qtransform.core import io as qio
from qtransform.errors import UserError
from tests.robustness.conftest import REPO, W4A16, snapshot


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_transform_replaces_its_previous_output_as_a_whole_and_honours_umask(cli, models, tmp_path):
    out = tmp_path / "out"
    first = cli("transform", models["qwen2"], W4A16, "--out", out, umask=0o027)
    assert first.rc == 0, first.stderr
    manifest = json.loads((out / qio.MANIFEST).read_text())
    assert manifest["command"] == "transform" and manifest["complete"] is True
    assert sorted(manifest["files"]) == sorted(p for p in _files(out) if p != qio.MANIFEST)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~0o027  # not mkdtemp's 0700
    (out / "stale.txt").write_text("left by an older version")  # replaced with the folder
    second = cli("transform", models["qwen2"], W4A16, "--out", out)
    assert second.rc == 0, second.stderr
    assert not (out / "stale.txt").exists() and (out / "qtransform_policy.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging, old or lock left


def test_force_replaces_a_foreign_folder_but_nothing_beside_it(cli, models, tmp_path):
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "x.txt").write_text("x")
    (tmp_path / "neighbour.txt").write_text("keep me")
    result = cli("transform", models["qwen2"], W4A16, "--out", target, "--force")
    assert result.rc == 0, result.stderr
    assert not (target / "sub").exists() and (target / "config.json").exists()
    assert (tmp_path / "neighbour.txt").read_text() == "keep me"


def test_empty_existing_folder_is_used(cli, models, tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("scan", models["qwen2"], "--format", "mxfp4", "--out", tmp_path / "empty")
    assert result.rc == 0, result.stderr
    assert (tmp_path / "empty" / "report.json").exists()


def test_a_scan_output_is_not_replaced_by_another_command(cli, models, tmp_path):
    out = tmp_path / "out"
    assert cli("scan", models["qwen2"], "--format", "mxfp4", "--out", out).rc == 0
    before = snapshot(out)
    cli("transform", models["qwen2"], W4A16, "--out", out).assert_user_error(
        "output of `qtransform scan`", "--force")
    assert snapshot(out) == before


def test_a_concurrent_run_gets_a_clear_in_use_message(cli, models, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    with open(lock, "w") as held:  # what a running `qtransform transform --out out` holds
        fcntl.flock(held, fcntl.LOCK_EX)
        cli("transform", models["qwen2"], W4A16, "--out", out).assert_user_error("in use")
    assert not out.exists()


def test_two_runs_at_once_on_one_folder_never_fail_with_an_os_error(models, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qtransform.cli.main", "transform", str(models["qwen2"]),
           str(W4A16), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for rc, err in results:
        assert rc == 0 or (rc == 2 and "in use by another qtransform run" in err), err
        assert "Traceback" not in err
    assert any(rc == 0 for rc, _ in results)
    assert json.loads((out / qio.MANIFEST).read_text())["complete"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_is_refused_before_the_work(cli, models, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        cli("transform", models["qwen2"], W4A16, "--out", parent / "out").assert_user_error(
            "not writable")
    finally:
        parent.chmod(0o755)


def test_atomic_path_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for name, words in (("pipe", "FIFO"), ("dir", "is a folder"), ("link", "dangling")):
        with pytest.raises(UserError, match=words):
            qio.write_text(tmp_path / name, "x")
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)


def test_output_folder_leaves_the_old_folder_when_the_work_fails(tmp_path):
    out = tmp_path / "out"
    with qio.output_folder(out, "scan") as staging:
        (staging / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), qio.output_folder(out, "scan") as staging:
        (staging / "a.txt").write_text("new, half done")
        raise RuntimeError("the work failed")
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
