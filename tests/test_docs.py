"""The docs name what exists: every repository path, module and link in README.md and docs/*.md.

Docs drift when modules move (`qtransform/io.py` became `qtransform/core/io.py`, `qtransform.noise`
became `qtransform.core.schedule` and `qtransform.rl.noise`); a reader then looks for a file that
is not there. A backticked path counts as a repository path when its first folder is one of the
repository's (or of `qtransform/`, as docs/architecture.md writes `core/io.py`) and it names a
file (an extension) or a folder (a trailing `/`); `qtransform.x.y` must import or be an attribute,
a report schema id, or an op of the exported ONNX domain.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from qtransform import formats
from tests.conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
FILE = re.compile(r"^[A-Za-z0-9_.\-*/]+(\.(py|md|json|c|txt|toml|sh|cfg)|/)$")
DOTTED = re.compile(r"^qtransform(\.[A-Za-z_][A-Za-z0-9_]*)+$")
ONNX_OPS = {"Noise", "Tap", *(formats.get(name).onnx_op for name in formats.names())}
SOURCE_TEXT = "\n".join(p.read_text() for root in ("qtransform", "passes", "schemas")
                        for p in (REPO / root).rglob("*.py"))


def roots() -> set[str]:
    """Top-level folders of the repository and of the package (the first part of a doc path)."""
    return {p.name for base in (REPO, REPO / "qtransform") for p in base.iterdir()
            if p.is_dir() and not p.name.startswith((".venv", "__", "build"))} | {".ci"}


def exists(path: str) -> bool:
    return any(any(base.glob(path.rstrip("/"))) if "*" in path else (base / path).exists()
               for base in (REPO, REPO / "qtransform"))


def resolves(dotted: str) -> bool:
    """An importable module, or an attribute of one, or a schema id / ONNX op of qtransform."""
    parts = dotted.split(".")
    if len(parts) == 2 and (parts[1] in ONNX_OPS or f'"{dotted}"' in SOURCE_TEXT):
        return True
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def named(doc: Path) -> tuple[list[str], list[str], list[str]]:
    """(repository paths, qtransform dotted names, relative links) that `doc` names."""
    text = doc.read_text(encoding="utf-8")
    ticks = [t.strip() for t in re.findall(r"`([^`\n]+)`", text)]
    top = roots()
    paths = [t for t in ticks if FILE.match(t) and t.split("/")[0] in top and "/" in t]
    links = [link for link in re.findall(r"\]\(([^)#\s]+)", text) if ":" not in link]
    return paths, [t for t in ticks if DOTTED.match(t)], links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_module_and_link_a_doc_names_exists(doc):
    paths, dotted, links = named(doc)
    missing = [p for p in paths if not exists(p)]
    missing += [d for d in dotted if not resolves(d)]
    missing += [link for link in links if not (doc.parent / link).exists()]
    assert not missing, f"{doc.name} names what does not exist: {missing}"


def test_the_check_sees_paths_and_modules():
    """The docs name enough for the test to mean something, and a stale name is caught."""
    found = [named(doc) for doc in DOCS]
    assert sum(len(p) for p, _, _ in found) > 50 and sum(len(d) for _, d, _ in found) > 20
    assert not exists("qtransform/io.py") and exists("qtransform/core/io.py") and exists("core/io.py")
    assert exists("passes/*.py") and exists("schemas/examples/")
    assert not resolves("qtransform.noise") and not resolves("qtransform.fault_scan")
    assert resolves("qtransform.scan.faults.gain_scan") and resolves("qtransform.MXFP4FakeQuant")
    assert resolves("qtransform.scan_report")  # a report's schema id


def test_every_policy_section_is_in_the_readme_and_the_policy_reference():
    from qtransform.schemas.sections import ordered

    names = [section.name for section in ordered()]
    assert "clamp" in names
    for doc in (REPO / "README.md", REPO / "docs" / "policy.md"):
        text = doc.read_text(encoding="utf-8")
        assert not [n for n in names if f"`{n}`" not in text], doc.name
    policy_md = (REPO / "docs" / "policy.md").read_text(encoding="utf-8")
    assert not [n for n in names if f"**`{n}`**" not in policy_md]  # a paragraph each


def test_the_readme_lists_every_builtin_model():
    from qtransform.models import BUILTIN

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"`builtin:<{'|'.join(BUILTIN)}>`" in readme
