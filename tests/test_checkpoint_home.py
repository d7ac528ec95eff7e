"""One home per checkpoint format: the counts docs/architecture.md gives ("Extending": the files
of a new checkpoint format, of a new scheme) are read from the doc and checked against the code,
so neither the doc nor the code can drift (a third module importing a format, a scheme name
spelled outside its format's module, a writer without its reader)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qtransform.checkpoints import FORMATS
from qtransform.export.checkpoint.formats import WRITERS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("qtransform", "passes", "schemas") for p in (ROOT / folder).rglob("*.py")]


def row(extension: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    found = re.search(rf"^\| {extension} \| (.+?) \|", text, re.MULTILINE)
    assert found, f"docs/architecture.md's Extending table has no row '{extension}'"
    return found.group(1)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("passes", "schemas"):
        parts.insert(0, "qtransform")
    return ".".join(p for p in parts if p != "__init__")


def imported(path: Path) -> set[str]:
    """Every module `path` imports (`from a import b` counts as a.b too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def literal_files(value: str) -> set[str]:
    """The source files holding the string constant `value` (exactly, not inside other text),
    outside the presets (the table's "plus" column: a stack's preset names its scheme in its own
    words, such as llm-compressor's preset "NVFP4")."""
    hits = set()
    for path in SOURCES:
        if "presets" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == value:
                hits.add(module_name(path))
    return hits


def test_every_format_has_a_reader_and_a_writer_under_one_name():
    assert set(FORMATS) == set(WRITERS)
    for name, vocabulary in FORMATS.items():
        assert vocabulary.NAME == WRITERS[name].NAME == name


def test_a_new_checkpoint_format_is_the_documented_modules_and_registry_entries():
    text = row("a checkpoint format")
    modules = int(re.match(r"(\d+) modules", text).group(1))
    registries = int(re.search(r"\+ (\d+) registry entries", text).group(1))
    for name, vocabulary in FORMATS.items():
        writer = WRITERS[name]
        own = {vocabulary.__name__, writer.__name__}
        assert len(own) == modules
        users = {module_name(p) for p in SOURCES if own & imported(p)} - own
        # the registries alone reach a format: nothing else branches on it
        assert users == {"qtransform.checkpoints.reader", "qtransform.export.checkpoint.formats"}, users
        assert len(users) == registries


def test_a_new_scheme_is_one_row_in_one_module():
    modules = int(re.match(r"(\d+) module", row("a checkpoint scheme")).group(1))
    for vocabulary in FORMATS.values():
        assert vocabulary.LAYOUTS
        for key, layout in vocabulary.LAYOUTS.items():
            assert literal_files(layout.format) == {vocabulary.__name__}, layout.format
            assert len(literal_files(layout.format)) == modules
            # the key (ModelOpt's quant_algo "FP8" is also a common word): never in a reader or writer
            near = {m for m in literal_files(key) if ".checkpoints." in m or ".export." in m}
            assert near == {vocabulary.__name__}, key
