"""Every script in examples/ runs (on tiny config-built models) and does what the README says."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import onnx
import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"


def example(name: str) -> ModuleType:
    """Import examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_tested():
    tested = {"train_w4a16_aqn", "scan_model", "export_onnx", "rl_rollout_loop", "verl_rollout_sync"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_train_w4a16_aqn(capsys):
    result = example("train_w4a16_aqn").main(["--tiny", "--steps", "6"])
    out = capsys.readouterr().out
    sigmas = [float(line.split("sigma")[1]) for line in out.splitlines() if line.startswith("step")]
    assert len(sigmas) == 6 and sigmas[0] == 0.0 and max(sigmas) == 1e-2  # QeRL: noise-free start
    noisy = sigmas[sigmas.index(1e-2):]
    assert noisy == sorted(noisy, reverse=True) and noisy[-1] < 1e-2  # then decays
    assert result["reloaded_identical"] is True


def test_scan_model(tmp_path, capsys):
    result = example("scan_model").main(["--tiny", "--out", str(tmp_path)])
    for name in ("weights", "activations"):
        assert (tmp_path / name / "report.json").exists() and (tmp_path / name / "report.png").exists()
    assert result["comparison"].formats == ["mxfp4", "nvfp4"]
    assert "perplexity" in capsys.readouterr().out  # a causal LM: end-to-end perplexity


def test_export_onnx(tmp_path):
    result = example("export_onnx").main(["--tiny", "--out", str(tmp_path / "tiny.onnx")])
    assert result["max_abs_diff"] < 1e-4
    assert len(result["taps"]) == 2 * 3 * 2  # 2 layers x (gate, up, down) x (input, output)
    outputs = {o.name for o in onnx.load(str(result["path"])).graph.output}
    assert set(result["taps"]) <= outputs


def test_rl_rollout_loop(capsys):
    result = example("rl_rollout_loop").main(["--tiny", "--steps", "4", "--group", "2"])
    # QeRL's schedule over 4 steps, K=4: interval 0 clean, then 1e-2, 1e-3, 1e-4
    assert result["sigmas"] == pytest.approx([0.0, 1e-2, 1e-3, 1e-4])
    noise = result["noise"]
    assert noise["step"] == 4 and noise["silent"] is None
    assert noise["noised_syncs"] == 1 and noise["noised_forwards"] > 0
    assert result["parity"].tokens == 8 and result["parity"].max_abs_delta > 0  # clean trainer vs noised rollout
    assert "sigma 0.01" in capsys.readouterr().out


def test_verl_rollout_sync_filters_the_stream_merged_and_not():
    result = example("verl_rollout_sync").main(["--tiny"])
    assert result["max_abs_diff_merged"] == 0.0  # the engine gets the rollout's own dense weights
    assert 0.0 <= result["max_abs_diff_unmerged"] < 1e-5  # the engine adds the adapters itself
