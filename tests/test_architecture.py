"""The layer contract: packages import downward only, and nothing imports in a cycle.

Every import counts, also those inside functions: the graph is read from the source with `ast`,
so a lazy import cannot hide an upward dependency. docs/architecture.md draws the same layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"qtransform": ROOT / "qtransform", "qtransform.passes": ROOT / "passes",
                "qtransform.schemas": ROOT / "schemas"}

# Lowest first. A module may import modules of its own layer or of lower layers only.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("numerics", ("qtransform.errors", "qtransform.formats")),
    ("core", ("qtransform.core", "qtransform.checkpoints", "qtransform.models", "qtransform.calibration")),
    ("policy", ("qtransform.schemas",)),
    ("pipeline", ("qtransform.pipeline",)),
    ("passes", ("qtransform.passes",)),
    ("outputs", ("qtransform.scan", "qtransform.export", "qtransform.rl")),
    ("reports", ("qtransform.report",)),
    ("integrations", ("qtransform.integrations",)),
    ("cli", ("qtransform.cli",)),
]
# Sibling packages of one layer that must not know each other.
INDEPENDENT = [("qtransform.scan", "qtransform.export"), ("qtransform.export", "qtransform.rl"),
               ("qtransform.scan", "qtransform.rl")]


def module_files() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith("qtransform.qtransform"):
                continue
            found[name] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every qtransform module `path` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for n in ast.walk(block)}  # annotations only: no runtime dependency
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t == "qtransform" or t.startswith("qtransform."))
    return {t for t in out if t != name}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def layer_of(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    files = module_files()
    g = nx.DiGraph()
    for name, path in files.items():
        g.add_node(name)
        for target in imports_of(name, path, set(files)):
            g.add_edge(name, target)
    return g


def test_every_module_belongs_to_a_layer(graph):
    orphans = [m for m in graph.nodes if m != "qtransform" and layer_of(m) is None]
    assert orphans == []


def test_layers_import_downward_only(graph):
    upward = []
    for src, dst in graph.edges:
        if src == "qtransform" or dst == "qtransform":  # the façade is the top; nothing imports it
            if dst == "qtransform":
                upward.append(f"{src} -> the qtransform façade (import the module that defines it)")
            continue
        if layer_of(dst) > layer_of(src):
            upward.append(f"{src} ({LAYERS[layer_of(src)][0]}) -> {dst} ({LAYERS[layer_of(dst)][0]})")
    assert upward == []


def test_sibling_outputs_do_not_import_each_other(graph):
    crossing = [f"{s} -> {d}" for s, d in graph.edges for a, b in INDEPENDENT
                if (s.startswith(a) and d.startswith(b)) or (s.startswith(b) and d.startswith(a))]
    assert crossing == []


def test_no_import_cycles(graph):
    # package __init__ modules re-export their children; an edge child -> own package is the
    # implicit parent import Python does anyway, so only real module-to-module cycles count
    g = graph.copy()
    g.remove_edges_from([(s, d) for s, d in graph.edges if s.startswith(d + ".")])
    assert list(nx.simple_cycles(g)) == []


def test_the_contract_sees_function_level_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from qtransform.cli import main\n    return main\n")
    assert imports_of("qtransform.core.x", sample, {"qtransform.cli.main"}) == {"qtransform.cli.main"}
