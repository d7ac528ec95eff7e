"""Headless Chromium as the tests' browser: a real subprocess renders a page from disk.

Skips where chromium is absent, except under CI=true, where its absence fails (.ci/run installs
Debian's `chromium`)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--virtual-time-budget=20000"]


def chromium() -> str:
    """The chromium executable, or a skip (a failure in CI) saying how to get it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the browser tests: chromium is not installed (.ci/run installs it)")
        pytest.skip("headless Chromium is not installed (apt-get install -y chromium)")
    return found


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # chromium writes its profile under HOME; a temporary one keeps runs independent
    env = {**os.environ, "HOME": str(cwd)}
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={cwd / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env=env, check=True)


def dump_dom(page: Path, scratch: Path) -> str:
    """The page's DOM after its scripts ran (figures drawn, tables built)."""
    return _run(["--dump-dom", page.resolve().as_uri()], scratch).stdout


def screenshot(page: Path, scratch: Path, size: str = "1200,1600") -> Path:
    """A PNG of the rendered page."""
    out = scratch / (page.stem + ".png")
    _run([f"--screenshot={out}", f"--window-size={size}", page.resolve().as_uri()], scratch)
    return out


def pixel_std(png: Path) -> float:
    """Standard deviation of the screenshot's gray levels: 0 for a blank page."""
    import numpy as np
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(png.read_bytes()), format="png")
    return float(np.asarray(pixels)[..., :3].mean(axis=-1).std())
