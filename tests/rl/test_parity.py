"""The parity report: an engine that serves the rollout weights has no gap, one given the clean
weights shows it, and the statistics match a hand-worked case (an engine whose log-probs are the
trainer's shifted by a constant, scored by a plain model with torch's log_softmax)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import qtransform
from qtransform.cli.main import main
from qtransform.rl import HFEngine, parity
from qtransform.rl.parity import compare, trainer_logprobs
from tests.tiny_rl import tiny_qwen2

POLICY = {"version": 1,
          "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}],
          "noise": {"targets": ["RMSNorm"], "seed": 3,
                    "schedule": {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005,
                                 "num_stages": 4, "total_steps": 40}}}
PROMPTS = [[5, 17, 33, 8], [90, 4, 61, 22, 7]]


def transformed(step: int = 12) -> torch.nn.Module:
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(step)
    return model


def test_an_engine_with_the_rollout_weights_has_no_gap_and_a_clean_one_shows_it(tmp_path):
    model = transformed()
    served = tiny_qwen2(seed=7)
    served.load_state_dict(dict(qtransform.rollout_weights(model)))
    same = parity(model, HFEngine(served), PROMPTS, max_new_tokens=6, phase="rollout")
    assert same.max_abs_delta == 0.0 and same.greedy_agreement == 1.0 and same.k1 == [0.0, 0.0]
    assert same.tokens == sum(len(s["completion"]) for s in same.samples) > 6  # ends at EOS or 6

    gap = parity(model, HFEngine(tiny_qwen2()), PROMPTS, max_new_tokens=6, phase="rollout")
    assert gap.max_abs_delta > 1e-3 and gap.mean_k3 > 0
    assert gap.largest[0]["delta"] == pytest.approx(max((d for s in gap.deltas for d in s), key=abs))
    # in the train phase the trainer is clean: the served rollout differs by AQN's noise alone
    train = parity(model, HFEngine(served), PROMPTS, max_new_tokens=6, phase="train")
    assert train.max_abs_delta > 0

    paths = gap.save(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["max_abs_delta"] == gap.max_abs_delta and len(data["largest"]) == min(10, gap.tokens)
    assert "| sequence | position | token |" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_of_a_constant_shift():
    model = transformed(step=0)  # noise-free: the plain reference below scores the same weights
    plain = tiny_qwen2()
    plain.load_state_dict(dict(qtransform.rollout_weights(model)))
    shift = 0.125

    def engine(prompt: list[int], completion: list[int]) -> list[float]:
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + completion])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        return [float(lp[len(prompt) - 1 + i, t]) + shift for i, t in enumerate(completion)]

    completions = [[9, 10, 11], [12, 13, 14, 15]]
    report = parity(model, engine, PROMPTS, completions)
    assert report.tokens == 7 and report.greedy_agreement is None
    assert report.mean_abs_delta == pytest.approx(shift, abs=1e-6)
    assert report.k1 == pytest.approx([3 * shift, 4 * shift], abs=1e-5)
    k3 = math.exp(-shift) - 1 + shift  # exp(r) - 1 - r with r = lp_trainer - lp_engine = -shift
    assert report.k3 == pytest.approx([3 * k3, 4 * k3], rel=1e-4)


def test_parity_cli(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    args = ["parity", "builtin:qwen2", "--policy", str(policy), "--step", "12",
            "--max-new-tokens", "4", "--num-prompts", "2", "--phase", "rollout"]
    assert main([*args, "--engine", "rollout-weights", "--out", str(tmp_path / "same")]) == 0
    assert json.loads((tmp_path / "same" / "parity.json").read_text())["max_abs_delta"] == 0.0
    assert main([*args, "--engine", "clean", "--out", str(tmp_path / "gap")]) == 0
    gap = json.loads((tmp_path / "gap" / "parity.json").read_text())
    assert gap["max_abs_delta"] > 1e-3 and (tmp_path / "gap" / "parity.png").exists()
    assert "greedy agreement" in capsys.readouterr().out
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("x")
    assert main([*args, "--out", str(foreign)]) == 2  # a folder qtransform did not write
    assert (foreign / "mine.txt").read_text() == "x"


# -- sampler replay, verl's metrics, the floor, attribution --------------------------------------
SAMPLERS = [dict(temperature=0.7), dict(top_k=20), dict(top_p=0.8, temperature=0.7),
            dict(temperature=0.7, top_k=30, top_p=0.9, min_p=0.02)]


def peaked(seed: int = 0) -> torch.nn.Module:
    """The tiny Qwen2 with a 10x lm_head: next-token distributions peaked as a trained model's,
    so temperature and top-p change them (the random model's are nearly uniform)."""
    model = tiny_qwen2(seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


def served_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The original architecture loaded with the rollout weights (a plain HF model)."""
    served = tiny_qwen2(seed=7)
    served.load_state_dict(dict(qtransform.rollout_weights(model)))
    return served


@pytest.mark.parametrize("sampler", SAMPLERS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampler_replay_finds_no_gap_between_identical_models(sampler):
    model = qtransform.transform(peaked(), POLICY)
    qtransform.noise_controller(model).set_step(12)  # AQN on in the rollout phase and the copy
    engine = HFEngine(served_copy(model))
    report = parity(model, engine, PROMPTS, max_new_tokens=12, phase="rollout", **sampler)
    assert report.metrics["kl"] == 0.0 and report.metrics["k3_kl"] == 0.0
    assert report.metrics["chi2_token"] == 0.0 and report.metrics["ess"] == 1.0
    assert report.max_abs_delta == 0.0 and report.outside_support == 0
    assert report.meta["sampler"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                                      "order": "hf", **sampler}

    # the engine's processed log-probs are the ones generate sampled from (its own scores)
    completion = [s["completion"] for s in report.samples][0]
    sampling = qtransform.rl.Sampling(**sampler, order="hf")
    out = engine.model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=len(completion),
                                pad_token_id=0, output_scores=True,
                                return_dict_in_generate=True, **sampling.generate_kwargs())
    forced = out.sequences[0, len(PROMPTS[0]):].tolist()
    scores = [float(s[0].double().log_softmax(-1)[t]) for s, t in zip(out.scores, forced, strict=True)]
    assert engine.logprobs(PROMPTS[0], forced, sampling) == pytest.approx(scores, abs=1e-5)

    # without replay (the trainer at temperature 1, full vocabulary) the same pair shows a gap
    raw = [trainer_logprobs(model, p, s["completion"], qtransform.rl.Sampling(), "rollout")
           for p, s in zip(PROMPTS, report.samples, strict=True)]
    processed = [engine.logprobs(p, s["completion"], sampling)
                 for p, s in zip(PROMPTS, report.samples, strict=True)]
    assert compare(raw, processed)[0]["kl"] > 0.01


def verl_by_hand(trainer: list[list[float]], rollout: list[list[float]]) -> dict[str, float]:
    """verl's rollout_corr formulas (STACKS.md), written out in Python floats."""
    r = [[t - e for t, e in zip(ts, es, strict=True)] for ts, es in zip(trainer, rollout, strict=True)]
    flat = [x for row in r for x in row]
    n = len(flat)
    mean_t = [sum(ts) / len(ts) for ts in trainer]
    mean_e = [sum(es) / len(es) for es in rollout]
    diff = [e - t for t, e in zip(mean_t, mean_e, strict=True)]
    clamp = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731
    return {"kl": sum(-x for x in flat) / n,
            "k3_kl": sum(math.exp(x) - x - 1 for x in flat) / n,
            "training_ppl": sum(math.exp(-m) for m in mean_t) / len(mean_t),
            "rollout_ppl": sum(math.exp(-m) for m in mean_e) / len(mean_e),
            "log_ppl_diff": sum(diff) / len(diff),
            "log_ppl_abs_diff": sum(abs(d) for d in diff) / len(diff),
            "ppl_ratio": sum(math.exp(d) for d in diff) / len(diff),
            "chi2_token": sum(math.exp(clamp(x)) ** 2 for x in flat) / n - 1,
            "chi2_seq": sum(math.exp(2 * clamp(sum(row))) for row in r) / len(r) - 1}


def warped(model: torch.nn.Module, prompt: list[int], completion: list[int], **sampler) -> list[float]:
    """Processed log-probs through transformers' own processors (the test's independent side)."""
    from tests.rl.test_sampling import transformers_processed

    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    lp = transformers_processed(logits, qtransform.rl.Sampling(**sampler)).double().log_softmax(-1)
    return [float(lp[i, t]) for i, t in enumerate(completion)]


def test_the_metrics_are_verls_formulas_on_a_quantized_trainer():
    model = transformed(step=0)
    clean = tiny_qwen2()
    sampler = dict(temperature=0.8, top_k=60)
    report = parity(model, HFEngine(clean), PROMPTS, max_new_tokens=10, **sampler)
    completions = [s["completion"] for s in report.samples]
    trainer = [warped(model, p, c, **sampler) for p, c in zip(PROMPTS, completions, strict=True)]
    rollout = [warped(clean, p, c, **sampler) for p, c in zip(PROMPTS, completions, strict=True)]
    # a token outside the trainer's top-k (log-prob -inf, importance ratio 0) is left out
    inside = [[(t, e) for t, e in zip(ts, es, strict=True) if math.isfinite(t)]
              for ts, es in zip(trainer, rollout, strict=True)]
    assert report.outside_support == sum(map(len, trainer)) - sum(map(len, inside))
    want = verl_by_hand([[t for t, _ in row] for row in inside], [[e for _, e in row] for row in inside])
    assert want["k3_kl"] > 1e-6  # a real gap: NVFP4 against the clean weights
    for key, value in want.items():
        assert report.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert 0 < report.metrics["ess"] <= 1
    assert report.metrics["ratio_p05"] <= report.metrics["ratio_p50"] <= report.metrics["ratio_p95"]


def test_the_floor_is_the_original_model_against_the_same_engine():
    model = transformed(step=0)  # noise-free step: the served copy is the quantized model
    engine = HFEngine(served_copy(model))
    report = parity(model, engine, PROMPTS, max_new_tokens=8, top_p=0.9)
    assert report.metrics["kl"] == 0.0  # the trainer is what the engine serves
    completions = [s["completion"] for s in report.samples]
    original = parity(tiny_qwen2(), engine, PROMPTS, completions, top_p=0.9, floor=False)
    assert report.floor == original.metrics and report.floor["k3_kl"] > 1e-6
    assert report.gap == {k: report.metrics[k] - report.floor[k] for k in report.metrics}
    # the switches are back: the model computes what it computed before
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, transformed(step=0)(ids).logits)


def test_attribution_ranks_the_one_coarse_site_first(tmp_path):
    coarse = "model.layers.1.self_attn.v_proj"
    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head", coarse], "format": "mxfp8_e4m3"},
        {"targets": [coarse], "format": "int4", "block_size": 64}]}
    model = qtransform.transform(tiny_qwen2(), policy)
    report = parity(model, HFEngine(tiny_qwen2()), PROMPTS, max_new_tokens=10, attribute=True,
                    temperature=0.7)
    assert report.floor["k3_kl"] == 0.0  # every site off: the engine's own model
    ranked = report.attribution
    assert [r["rank"] for r in ranked] == list(range(1, 15)) and ranked[0]["site"] == coarse
    assert ranked[0]["added"] > 5 * ranked[1]["added"] > 0
    assert ranked[0]["modules"] == ["FakeQuantize"]
    text = report.markdown()
    assert "## Attribution: one site on at a time" in text and f"| 1 | {coarse} |" in text
    assert f"1. {coarse}" in "\n".join(report.summary())


def byte_folder(path) -> str:
    """A tiny Qwen2 folder with a byte-level tokenizer that AutoTokenizer loads (256 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from qtransform.models import build_tiny

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    build_tiny("qwen2").save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0]).save_pretrained(path)
    return str(path)


def test_text_prompts_and_the_runs_metadata(tmp_path):
    from qtransform.models import load_model, load_tokenizer

    folder = byte_folder(tmp_path / "model")
    model = qtransform.transform(load_model(folder), POLICY)
    qtransform.noise_controller(model).hold(12)
    texts = ["What is 7 + 5?", "Name a colour | or two"]
    report = parity(model, HFEngine(load_model(folder)), texts, max_new_tokens=5, top_p=0.9,
                    metadata={"note": "mine"})
    tokenizer = load_tokenizer(folder)
    assert [s["prompt"] for s in report.samples] == [tokenizer.encode(t) for t in texts]
    assert [s["prompt_text"] for s in report.samples] == texts
    assert all(s["completion_text"] == tokenizer.decode(s["completion"]) for s in report.samples)
    meta = report.meta
    assert meta["model"] == folder and meta["controller_step"] == 12 and meta["phase"] == "train"
    assert meta["engine"] == "hf (Qwen2ForCausalLM)" and meta["note"] == "mine"
    assert meta["sampler"]["top_p"] == 0.9 and meta["seed"] == 0
    assert meta["qtransform_version"] == qtransform.__version__ and meta["date"].endswith("+00:00")
    md = report.markdown()
    assert "`What is 7 + 5?`" in md and "`Name a colour \\| or two`" in md
    with pytest.raises(qtransform.UserError, match="tokenizer"):
        parity(qtransform.transform(tiny_qwen2(), POLICY), HFEngine(tiny_qwen2()), texts)


def test_parity_cli_replays_the_sampler_with_text_prompts(tmp_path):
    import hashlib
    import subprocess
    import sys

    folder = byte_folder(tmp_path / "model")
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 7 + 5?\n\nName a colour.\n")
    out = tmp_path / "parity"
    run = subprocess.run(
        [sys.executable, "-m", "qtransform.cli.main", "parity", folder, "--policy", str(policy),
         "--engine", "clean", "--prompts", str(prompts), "--temperature", "0.7", "--top-p", "0.8",
         "--max-new-tokens", "6", "--attribute", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "parity.json").read_text())
    meta = report["meta"]
    assert meta["model_path"] == folder and meta["engine_kind"] == "clean"
    assert meta["policy"] == POLICY and meta["controller_step"] == 0
    assert meta["policy_sha256"] == hashlib.sha256(policy.read_bytes()).hexdigest()
    assert meta["sampler"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.8, "min_p": 0.0, "order": "hf"}
    assert report["floor"]["kl"] == 0.0 and report["metrics"]["k3_kl"] > 0
    assert report["attribution"][0]["rank"] == 1 and len(report["samples"]) == 2
    assert "`What is 7 + 5?`" in (out / "parity.md").read_text()
    assert "floor" in run.stdout and "sites by k3_kl" in run.stdout
    # a one-shot run at a noise-free step: no training-loop advice at exit
    assert "step() once per optimizer step" not in run.stderr


def test_a_loop_that_never_steps_still_gets_the_advice(tmp_path):
    import subprocess
    import sys

    script = ("import torch, qtransform\n"
              "from tests.tiny_rl import tiny_qwen2\n"
              f"m = qtransform.transform(tiny_qwen2(), {POLICY!r})\n"
              "m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "step() once per optimizer step" in run.stderr


def test_hold_fixes_a_step_without_the_never_stepped_advice():
    held = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(held).hold(0)
    looped = qtransform.transform(tiny_qwen2(), POLICY)
    for model in (held, looped):
        model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert qtransform.noise_controller(held).report()["silent"] is None
    assert "once per optimizer step" in qtransform.noise_controller(looped).report()["silent"]


def test_parity_cli_refuses_bad_sampler_and_prompts(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    base = ["parity", "builtin:qwen2", "--policy", str(policy), "--max-new-tokens", "2",
            "--num-prompts", "1"]
    assert main([*base, "--top-p", "0", "--out", str(tmp_path / "a")]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2]")
    assert main([*base, "--prompts", str(ids), "--out", str(tmp_path / "b")]) == 2
    assert "JSON list of non-empty token-id lists" in capsys.readouterr().err
    texts = tmp_path / "texts.txt"
    texts.write_text("What is 7 + 5?\n")
    assert main([*base, "--prompts", str(texts), "--out", str(tmp_path / "c")]) == 2
    assert "text prompts need a tokenizer" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")


# -- attention sites ------------------------------------------------------------------------------
VLLM_KV = {"preset": ["llm-compressor/FP8_DYNAMIC", "vllm/kv_fp8_e5m2"], "preset_options": {"backend": "cpu"}}
HEAD_KV = {"format": "fp8_e5m2", "targets": ["Attention"], "tensors": ["key", "value"], "granularity": "head"}
ENGINE = {"name": "vllm", "backend": "cpu"}


@pytest.mark.parametrize(("policy", "kv", "engine", "module"), [
    (VLLM_KV, {"format": "fp8_e5m2", "targets": ["Attention"], "tensors": ["key", "value"],
               "granularity": "tensor", "rounding": "rtz", "fp8_variant": "vllm-cpu", "scale_source": "fixed",
               "fixed_scale": 1.0},
     ENGINE, "FakeQuantize"),
    ({"quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp8_e4m3"}, HEAD_KV]},
     HEAD_KV, None, "HeadwiseQuantize"),
], ids=["vllm-kv-fp8-e5m2", "per-head"])
def test_attribution_measures_each_attention_site_alone(policy, kv, engine, module):
    model = qtransform.transform(tiny_qwen2(), policy)
    hf = HFEngine(tiny_qwen2())
    report = parity(model, hf, PROMPTS, max_new_tokens=10, attribute=True, temperature=0.7)
    rows = {r["site"]: r for r in report.attribution}
    completions = [s["completion"] for s in report.samples]

    def k3(policy: dict) -> float:
        """The k3_kl of a model transformed with `policy` alone (no switch touched)."""
        direct = qtransform.transform(tiny_qwen2(), policy) if policy else tiny_qwen2()
        return parity(direct, hf, PROMPTS, completions, temperature=0.7, floor=False).metrics["k3_kl"]

    floor = k3({"engine": engine} if engine else {})  # an engine kernel has no switch: it stays
    assert report.floor["k3_kl"] == pytest.approx(floor, rel=1e-12, abs=1e-15)
    for layer in (0, 1):
        row = rows[f"model.layers.{layer}.self_attn"]
        assert row["modules"] == [module] and row["points"] == ["key", "value"]
        alone = {"quantize": [{**kv, "layers": str(layer)}], **({"engine": engine} if engine else {})}
        assert row["added"] == pytest.approx(k3(alone) - floor, rel=1e-9, abs=1e-15)
        assert row["added"] > 1e-6  # FP8 E5M2 keys and values move the log-probs
    assert "weight" in rows["model.layers.0.mlp.up_proj"]["points"]
    assert "| model.layers.0.self_attn | " + module + " | key, value |" in report.markdown().replace(
        f"| {rows['model.layers.0.self_attn']['rank']} | ", "| ", 1)
