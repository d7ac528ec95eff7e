"""Every script in examples/ runs (on tiny config-built models) and does what the README says."""

from __future__ import annotations

import importlib.util
import json
import re
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
    tested = {"train_w4a16_aqn", "scan_model", "export_onnx", "rl_rollout_loop", "verl_rollout_sync",
              "grpo_smollm2_aqn", "fp4_training_recipes"}
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

def test_grpo_smollm2_aqn_rewards_check_the_exact_sum_and_the_format():
    grpo = example("grpo_smollm2_aqn")
    completions = ["12", "5 + 7 = 12", "12 apples, or 13", "twelve", [{"role": "assistant", "content": " 12\n"}]]
    assert grpo.correct(completions, answer=[12] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert grpo.number_only(completions) == [0.2, 0.0, 0.0, 0.0, 0.2]
    prompts, answers = grpo.arithmetic(3, seed=1)
    for prompt, answer in zip(prompts, answers, strict=True):
        a, b = (int(x) for x in re.findall(r"\d+", prompt))
        assert a + b == answer


def test_grpo_smollm2_aqn_core_logs_the_mismatch_of_both_runs(tmp_path):
    """The experiment's core on a tiny Llama with a real GRPOTrainer: both runs are identical
    while AQN's schedule is noise-free, and the noisy step's rollouts drift from the trainer."""
    pytest.importorskip("trl")
    from qtransform.models import build_tiny
    from tests.tiny_rl import prompts, tiny_tokenizer

    grpo = example("grpo_smollm2_aqn")
    out = tmp_path / "figs" / "grpo"
    result = grpo.experiment(
        build_tiny("llama"), tiny_tokenizer(), prompts(6), [5, 6, 7, 8, 9, 10], out, chat=False,
        model_name="builtin:llama", steps=3, prompts_per_step=2, generations=2, completion_tokens=4,
        learning_rate=1e-2, sigma_start=0.05, sigma_end=0.005, stages=3, seed=0)

    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["setup"]["steps"] == 3 and set(saved["runs"]) == {"no_aqn", "aqn"}
    plain, noised = saved["runs"]["no_aqn"]["rows"], saved["runs"]["aqn"]["rows"]
    metrics = [f"qtransform/mismatch/{k}" for k in ("kl", "k3_kl", "ppl_ratio", "chi2_token", "ess")]
    for rows in (plain, noised):
        assert [row["step"] for row in rows] == [1, 2, 3]
        assert all(key in row for row in rows for key in (*metrics, "reward"))
    assert [row["qtransform/sigma"] for row in noised] == pytest.approx([0.0, 0.05, 0.005])
    for key in metrics:  # step 1 is AQN's noise-free stage: the same samples, the same metrics
        assert noised[0][key] == plain[0][key]
    assert noised[1]["qtransform/mismatch/k3_kl"] > 1e3 * plain[1]["qtransform/mismatch/k3_kl"]
    assert all(abs(row["qtransform/mismatch/kl"]) < 1e-5 for row in plain)  # no noise: only rounding
    stage = saved["summary"]["aqn"]["by_sigma"]["0.05"]
    assert stage["steps"] == [2, 2] and stage["k3_kl"] == noised[1]["qtransform/mismatch/k3_kl"]
    assert saved["summary"]["aqn"]["reward_mean"] == pytest.approx(
        sum(row["reward"] for row in noised) / 3)
    assert result["summary"] == saved["summary"]

    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) < 200_000
    assert "| aqn |" in grpo.table(result)
    out.with_suffix(".png").unlink()
    assert grpo.main(["--replot", "--out", str(out)])["summary"] == saved["summary"]
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("argv", "message"), [
    (["--runs", "aqn,fp8"], "--runs takes a comma list"),
    (["--steps", "2"], "--stages must be between 3"),
    (["--replot", "--out", "nowhere/grpo"], "does not exist"),
])
def test_grpo_smollm2_aqn_refuses_bad_flags_before_loading_the_model(argv, message, capsys):
    with pytest.raises(SystemExit):
        example("grpo_smollm2_aqn").main(argv)
    assert message in capsys.readouterr().err


def test_fp4_training_recipes_trains_each_run_from_the_same_start_and_replots(tmp_path, capsys):
    recipes = example("fp4_training_recipes")
    out = tmp_path / "figs" / "recipes"
    argv = ["--steps", "3", "--seeds", "2", "--hidden", "64", "--layers", "1", "--threads", "1",
            "--runs", "plain", "nvfp4", "nvfp4_no_rht_no_sr", "--out", str(out)]
    assert recipes.main(argv) == 0
    table = capsys.readouterr().out
    saved = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    runs = saved["runs"]
    assert set(runs) == {"plain", "nvfp4", "nvfp4_no_rht_no_sr"} and saved["setup"]["seeds"] == 2
    assert all(len(r["loss"]) == 2 and all(len(c) == 3 for c in r["loss"]) for r in runs.values())
    # one start per seed: the two seeds differ, the quantized forward moves the first loss slightly
    first = {k: [c[0] for c in r["loss"]] for k, r in runs.items()}
    assert first["plain"][0] != first["plain"][1]
    assert all(abs(a - b) < 0.05 for a, b in zip(first["plain"], first["nvfp4"], strict=True))
    assert runs["nvfp4"]["loss"] != runs["nvfp4_no_rht_no_sr"]["loss"]  # the switches change training
    assert "| nvfp4_no_rht_no_sr |" in table and '"disable_rht": true' in table
    assert recipes.main(["--replot", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == table.strip()
