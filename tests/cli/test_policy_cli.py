"""`qtransform policy ...`: the main paths run as real subprocesses, started together since each
pays torch's import (~2 s of CPU); flag variants run through the same `main()` in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qtransform.cli.main import main
from qtransform.schemas import load_policy
from qtransform.schemas.generate import schema_text
from qtransform.schemas.presets import preset_names

REPO = Path(__file__).resolve().parents[2]
QERL = "schemas/examples/qerl_aqn.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "bad.json"
    bad.write_text(json.dumps({"quantize": [{"format": "mxfp5", "fromat": "x"}],
                               "noise": {"schedule": {"sigma_start": 0.2, "sigma_end": 0.0, "total_steps": 100}}}))
    script = Path(sys.executable).with_name("qtransform")  # the installed console script
    cases = {
        "ok": [sys.executable, "-m", "qtransform.cli.main", "policy", "validate", QERL],
        "bad": [str(script) if script.exists() else "qtransform", "policy", "validate", str(bad)],
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cmd in cases.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    for result in out.values():
        assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return out


def test_validate_ok(runs):
    r = runs["ok"]
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith(f"ok: {QERL}: 1 quantize rule(s) (nvfp4 W4A16), noise (exponential")


def test_validate_lists_every_problem_and_exits_2(runs):
    r = runs["bad"]
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0].startswith("error: invalid policy ") and lines[0].endswith("(3 problems):")
    assert any(x.strip().startswith("quantize[0].format: unknown format; got 'mxfp5'") and
               x.endswith("(did you mean 'mxfp4'?)") for x in lines)
    assert any(x.strip().startswith("quantize[0].fromat: unknown field") for x in lines)
    assert any(x.strip().startswith("noise.schedule.sigma_end: must be > 0") for x in lines)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(["policy", *args])
    except SystemExit as exc:  # argparse --help
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_validate_json_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"quantize": [{"format": "mxfp5", "fromat": "x"}]}))
    code, out, _ = cli(capsys, "validate", str(bad), "--json")
    report = json.loads(out)
    assert code == 2 and report["ok"] is False
    assert [e["path"] for e in report["errors"]] == ["quantize[0].format", "quantize[0].fromat"]
    code, out, _ = cli(capsys, "validate", QERL, "--json")
    assert code == 0 and load_policy(out) == load_policy(REPO / QERL)


def test_broken_json_gives_line_and_column(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{\n  "quantize": [\n')
    code, _, err = cli(capsys, "validate", str(broken))
    assert code == 2 and f"error: invalid policy {broken}: line 3, column 1: invalid JSON" in err


def test_total_steps_needs_legacy(capsys):
    code, _, err = cli(capsys, "validate", QERL, "--total-steps", "10")
    assert code == 2 and "--total-steps: only used with --legacy" in err


def test_legacy_conversion_prints_a_loadable_policy(tmp_path, capsys):
    legacy = tmp_path / "srdd_sigma.json"
    legacy.write_text(json.dumps({"base_sigma": 0.01, "layer_multipliers": {"14": 1.5, "15": 1.5}}))
    code, out, _ = cli(capsys, "validate", str(legacy), "--legacy", "--total-steps", "174", "--json")
    assert code == 0
    policy = load_policy(out)
    assert policy.noise.layer_multipliers == {14: 1.5, 15: 1.5} and policy.noise.schedule.total_steps == 174
    code, _, err = cli(capsys, "validate", str(legacy))
    assert code == 2 and "legacy SRDD sigma config" in err and "--legacy" in err


def test_explain(capsys):
    code, out, _ = cli(capsys, "explain", QERL)
    assert code == 0
    assert out.startswith("Rule 'w4a16' quantizes the weights (W4A16) of modules matching class Linear")
    assert "stage 0 is noise-free, then sigma = 0.01, 0.00562" in out


def test_schema(capsys):
    code, out, _ = cli(capsys, "schema")
    assert code == 0 and out == schema_text()


def test_presets_lists_every_preset_with_what_it_reproduces(capsys):
    code, out, _ = cli(capsys, "presets")
    lines = [line for line in out.splitlines() if not line.startswith(" ")]
    assert code == 0 and [line.split(": ", 1)[0] for line in lines] == preset_names()
    assert any(line.startswith("qerl: QeRL's rollout model") for line in lines)
    # a preset's options follow it, indented, with their values and defaults
    block = out.split("transformer-engine/NVFP4BlockScaling: ", 1)[1].splitlines()[1:]
    options = [line for line in block[:next(i for i, line in enumerate(block) if not line.startswith(" "))]]
    assert options[0] == ("    preset_options.disable_rht (true/false, default false): "
                          "NVTE_NVFP4_DISABLE_RHT: no Hadamard on the wgrad operands")
    assert any(line.startswith('    preset_options.backward_override (null/"high_precision"/"dequantized", '
                               "default null)") for line in options)
    assert any(line.startswith('    preset_options.nvfp4_4over6 ("none"/"weights"/"activations"/"all", '
                               'default "none")') for line in options)


def test_explain_and_validate_of_a_preset_policy(capsys, tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"preset": "qerl", "noise": {"schedule": {"total_steps": 100}}}')
    code, out, _ = cli(capsys, "explain", str(path))
    assert code == 0 and out.startswith("Preset qerl: QeRL's rollout model")
    assert "Rule 'llm-compressor/NVFP4A16 weights' quantizes the weights" in out
    code, out, _ = cli(capsys, "validate", str(path), "--json")
    assert code == 0 and load_policy(out) == load_policy(path)
    path.write_text('{"preset": "qerll"}')
    code, _, err = cli(capsys, "validate", str(path))
    assert code == 2 and err.strip().endswith("(did you mean 'qerl'?)") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["validate", "schema", "explain", "presets"])
def test_help_has_examples(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    assert code == 0 and f"qtransform policy {command}" in out.split("example", 1)[1]


@pytest.mark.parametrize("command", ["scan", "sensitivity"])
def test_every_format_option_has_a_flag(command):
    """The scan commands hand every choice option of `QuantConfig` to the formats: each needs
    its flag (a new option without one made every scan fail with an AttributeError)."""
    from qtransform.cli.main import build_parser
    from qtransform.cli.options import format_options
    from qtransform.formats.options import CHOICE_OPTIONS

    flags = [f"--{o.replace('_', '-')}" for o in ("granularity", *CHOICE_OPTIONS)]
    values = ["token", "floor", "rne", "default", "full", "input", "modelopt", "mse", "256", "transformer-engine"]
    argv = [command, "builtin:qwen2", "--format", "int8", "--calib", "c.txt", "--out", "o"]
    for flag, value in zip(flags, values, strict=True):
        argv += [flag, value]
    args = build_parser().parse_args(argv)
    assert format_options(args) == dict(zip(("granularity", *CHOICE_OPTIONS), values, strict=True))
