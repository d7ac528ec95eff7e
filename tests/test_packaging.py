"""The wheel holds the whole package: every subpackage and data file, under one namespace.

CI installs editable (which reads the source tree) and would not see a package left out of the
wheel; a wheel without `qtransform.export.families` once installed a `qtransform` that could not be
imported. This builds the wheel from a copy of the sources with setuptools' own build backend (what
`pip wheel` calls) and compares its file list with the folders on disk. `.ci/run` also installs it
in a fresh environment and runs `.ci/smoke_wheel.py` from outside the tree.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOTS = {"qtransform": "qtransform", "passes": "qtransform/passes", "schemas": "qtransform/schemas"}
SOURCES = ("pyproject.toml", "setup.py", "README.md", *ROOTS)
DATA = ("qtransform/schemas/policy.schema.json", "qtransform/data/calibration.txt",
        "qtransform/formats/qfast.c")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy2(path, src / name)
    build = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1]) as whl:
        return set(whl.namelist())


def installed_path(path: Path) -> str:
    """Where a source file lands in the wheel: passes/x.py -> qtransform/passes/x.py."""
    rel = path.relative_to(REPO)
    return "/".join((ROOTS[rel.parts[0]], *rel.parts[1:]))


def source_files(pattern: str) -> list[Path]:
    return sorted(p for root in ROOTS for p in (REPO / root).rglob(pattern) if "__pycache__" not in p.parts)


def test_every_package_and_module_is_in_the_wheel(wheel_files):
    packages = source_files("__init__.py")
    assert len(packages) >= 13 and REPO / "qtransform/export/families/__init__.py" in packages
    missing = [installed_path(p) for p in source_files("*.py") if installed_path(p) not in wheel_files]
    assert not missing, f"the wheel lacks {missing}"


def test_package_data_is_in_the_wheel(wheel_files):
    examples = [installed_path(p) for p in sorted((REPO / "schemas/examples").glob("*.json"))]
    assert examples and not {*examples, *DATA} - wheel_files


def test_one_namespace_and_nothing_else(wheel_files):
    """passes/ and schemas/ install inside qtransform, never as top-level packages; tests stay out."""
    top = {name.split("/")[0] for name in wheel_files}
    assert top == {"qtransform", "qtransform-0.1.0.dist-info"}
    entry = next(n for n in wheel_files if n.endswith("entry_points.txt"))
    assert entry  # the console script is checked by running it in .ci/smoke_wheel.py


def test_ci_runs_the_wheel_smoke_test_with_ci_set():
    """.ci/run installs the built wheel (not editable) and smoke-tests it; it exports CI, which
    the tests that must not skip in CI read (tests/formats/test_formats_fastpath.py)."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip wheel" in ci and ".ci/smoke_wheel.py" in ci and "qtransform-*.whl" in ci
    assert "CI=true" in ci
