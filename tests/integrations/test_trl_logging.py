"""Logging where users look: a GRPOTrainer run with `report_to=["tensorboard", "trackio"]`, offline,
and what the two reporters wrote read back from their own stores (tensorboard's event file with
its EventAccumulator, trackio's local SQLite store with its SQLiteStorage). The run is a subprocess
because trackio fixes its store's folder when it is first imported."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")
pytest.importorskip("trackio")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

RUN = textwrap.dedent("""
    import json, sys
    import datasets, peft, trl
    import qtransform
    from qtransform.integrations.trl import attach
    from tests.tiny_rl import prompts, tiny_qwen2, tiny_tokenizer

    out = sys.argv[1]
    schedule = {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005, "num_stages": 4,
                "total_steps": 4}
    policy = {"version": 1,
              "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
              "noise": {"targets": ["RMSNorm"], "schedule": schedule, "seed": 5}}
    args = trl.GRPOConfig(
        output_dir=out, use_cpu=True, report_to=["tensorboard", "trackio"],
        project="qtransform-logging", run_name="grpo", trackio_static_space_id=False,
        max_steps=%d, per_device_train_batch_size=2, num_generations=2, max_completion_length=4,
        logging_steps=1, learning_rate=1e-2, save_strategy="no", seed=0, bf16=False)
    trainer = trl.GRPOTrainer(
        model=qtransform.transform(tiny_qwen2(), policy),
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=datasets.Dataset.from_dict({"prompt": prompts(8)}),
        processing_class=tiny_tokenizer(),
        peft_config=peft.LoraConfig(r=4, target_modules="all-linear", lora_alpha=8))
    attach(trainer, weight_stats_every=2)
    trainer.train()

    from trackio.sqlite_storage import SQLiteStorage
    stored = SQLiteStorage.get_logs("qtransform-logging", "grpo")
    json.dump({"history": trainer.state.log_history,
               "trackio": [{k: v for k, v in row.items() if k != "timestamp"} for row in stored]},
              open(out + "/result.json", "w"), default=str)
""") % STEPS


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("grpo")
    env = {**os.environ, "TRACKIO_DIR": str(out / "trackio"), "HF_HUB_OFFLINE": "1",
           "TENSORBOARD_LOGGING_DIR": str(out / "tb"),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RUN, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "result.json").read_text())


def rows(result: dict) -> list[dict]:
    return [h for h in result["history"] if "loss" in h]


def test_tensorboard_holds_the_mismatch_sigma_and_weight_statistics(run):
    out, result = run
    files = list((out / "tb").rglob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = event_accumulator.EventAccumulator(str(files[0]), size_guidance={"scalars": 0}).Reload()
    tags = set(acc.Tags()["scalars"])
    history = rows(result)
    assert len(history) == STEPS
    for key in ("qtransform/sigma", "qtransform/mismatch/kl", "qtransform/mismatch/chi2_seq",
                "qtransform/mismatch/ess", "qtransform/noised_forwards"):
        written = {e.step: e.value for e in acc.Scalars(f"train/{key}")}
        expected = {h["step"]: h[key] for h in history}
        assert written == pytest.approx(expected, rel=1e-6, abs=1e-9), key  # tensorboard stores float32
    # sigma of the rollouts of each step: 0 at step 0 (the first row), then the schedule
    assert [h["qtransform/sigma"] for h in history] == pytest.approx([0.0, 0.05, 0.05 * 0.1 ** 0.5])
    # weight statistics every 2 optimizer steps: only the row of step 2 carries them
    site = "model.layers.0.self_attn.q_proj"
    sqnr = acc.Scalars(f"train/qtransform/weights/{site}/sqnr_db")
    assert [e.step for e in sqnr] == [2]
    assert 10 < sqnr[0].value < 40  # NVFP4 on a Gaussian-initialized weight: ~20 dB
    assert {f"train/qtransform/weights/{site}/{k}" for k in ("saturation", "deadzone")} <= tags
    assert "train/qtransform/weights/min_sqnr_db" in tags


def test_trackio_stores_the_same_rows(run):
    _, result = run
    # trackio counts its own steps; the trainer's step is in the row (`train/global_step`)
    stored = {row["train/global_step"]: row for row in result["trackio"] if "train/loss" in row}
    history = rows(result)
    assert sorted(stored) == [h["step"] for h in history]
    for h in history:
        row = stored[h["step"]]
        for key in ("qtransform/sigma", "qtransform/mismatch/kl", "qtransform/mismatch/k3_kl",
                    "qtransform/mismatch/ratio_p95", "qtransform/forwards"):
            assert row[f"train/{key}"] == pytest.approx(h[key], rel=1e-12), key
        assert math.isfinite(row["train/qtransform/mismatch/training_ppl"])
    assert "train/qtransform/weights/min_sqnr_db" in stored[2]
