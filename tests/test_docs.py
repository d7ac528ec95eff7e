"""The docs name what exists: every repository path, module and link in README.md and docs/*.md,
and every repository path in the docstrings and comments of the code (C comments included).

Docs drift when modules move (`qtransform/io.py` became `qtransform/core/io.py`, `qtransform.noise`
became `qtransform.core.schedule` and `qtransform.rl.noise`); a reader then looks for a file that
is not there. A backticked path counts as a repository path when its first folder is one of the
repository's (or of `qtransform/`, as docs/architecture.md writes `core/io.py`) and it names a
file (an extension) or a folder (a trailing `/`); `qtransform.x.y` must import or be an attribute,
a report schema id, or an op of the exported ONNX domain. Docstrings and comments name paths
without backticks; another project's path is written under its repository's name
(`verl/docs/algo/rollout_corr.md`), so its first folder is none of ours.

Nothing names an issue number ("issue 36", "#36"): a reader of the docs or the code never sees
the tracker, so the text says what it refers to. Another project's issue or pull request is
written as GitHub writes it, `owner/repo#N`.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

from qtransform import formats
from tests.conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
FILE = re.compile(r"^[A-Za-z0-9_.\-*/]+(\.(py|md|json|c|txt|toml|sh|cfg)|/)$")
DOTTED = re.compile(r"^qtransform(\.[A-Za-z_][A-Za-z0-9_]*)+$")
ONNX_OPS = {"Noise", "Tap", *(formats.get(name).onnx_op for name in formats.names())}
# a path in prose: folders, then a file with one of these extensions or a trailing "/"; not the
# tail of a URL or of another path, nor a template ("<out>/", "{name}/")
PROSE_PATH = re.compile(r"(?<![\w./:<>{}$~-])((?:[\w.\-]+/)+(?:[\w\-*]+(?:\.[\w\-]+)*"
                        r"\.(?:py|md|json|c|txt|toml|sh|cfg|npz|safetensors)\b|(?![\w*.{<])))")
# "issue 36", "Issues 17", "issue #19", "issue-36", "issue36", and a "#36" not attached to a
# repository's name (owner/repo#36 is another project's)
ISSUE = re.compile(r"\bissues?[ -]?#?\d+|(?<![\w/])#\d+\b", re.IGNORECASE)
CODE_ROOTS = ("qtransform", "passes", "schemas", "benches", "examples")
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


def prose(path: Path) -> str:
    """The docstrings (every string statement) and comments of a Python file; the comments of a
    C file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".c":
        return "\n".join(re.findall(r"/\*.*?\*/|//[^\n]*", text, flags=re.DOTALL))
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    parts = [t.string for t in tokens if t.type == tokenize.COMMENT]
    parts += [node.value.value for node in ast.walk(ast.parse(text))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return "\n".join(parts)


def prose_paths(text: str) -> list[str]:
    """The repository paths prose names (first folder one of the repository's or the package's)."""
    top = roots()
    return [p for p in PROSE_PATH.findall(text) if p.split("/")[0] in top]


def sources(*folders: str) -> list[Path]:
    """The Python and C files under the folders (this file aside: it spells out what it bans)."""
    files = {p for f in folders for ext in ("*.py", "*.c") for p in (REPO / f).rglob(ext)}
    return sorted(files - {Path(__file__).resolve()})


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


@pytest.mark.parametrize("folder", CODE_ROOTS)
def test_every_path_a_docstring_or_comment_names_exists(folder):
    missing = [f"{p.relative_to(REPO)}: {path}" for p in sources(folder)
               for path in prose_paths(prose(p)) if not exists(path)]
    assert not missing, f"docstrings and comments name paths that do not exist: {missing}"


def test_nothing_names_an_issue_number():
    whole = [*DOCS, REPO / ".ci" / "run", *(REPO / "benches").glob("*.sh")]
    texts = {p: p.read_text(encoding="utf-8") for p in whole}
    texts |= {p: prose(p) for p in sources(*CODE_ROOTS, "tests", "tests_vllm", "tests_llmc", ".ci")}
    found = [f"{p.relative_to(REPO)}: {m}" for p, text in texts.items() for m in ISSUE.findall(text)]
    assert not found, f"say what, not which issue: {found}"


def test_the_prose_checks_see_paths_and_issue_numbers(tmp_path):
    py = tmp_path / "m.py"
    py.write_text('"""See docs/onnx.md, core/io.py and qtransform/io.py (issue 36)."""\n'
                  "# tests/x/test_y.py, <out>/docs/, https://example.org/docs/a.md, #12\n"
                  'X = "docs/nope.md, issue 7"\n')
    c = tmp_path / "k.c"
    c.write_text('/* qtransform/metrics.py */\nint x; // docs/numerics.md\nconst char *s = "docs/no.md";\n')
    paths = sorted(prose_paths(prose(py)))
    assert paths == ["core/io.py", "docs/onnx.md", "qtransform/io.py", "tests/x/test_y.py"]
    assert [exists(p) for p in paths] == [True, True, False, False]
    assert prose_paths(prose(c)) == ["qtransform/metrics.py", "docs/numerics.md"]
    assert sorted(ISSUE.findall(prose(py))) == ["#12", "issue 36"]
    assert ISSUE.findall("Issue 36, issues 17, issue #19, issue-20, issue20") == [
        "Issue 36", "issues 17", "issue #19", "issue-20", "issue20"]
    assert not ISSUE.findall("huggingface/trl#6789, vllm-project/vllm#41045, mxfp4#1, 2 issues, ## 3")


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
