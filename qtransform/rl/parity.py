"""Rollout/trainer parity: how far a rollout engine's per-token log-probs drift from the trainer's.

The trainer scores completions with the transformed HF model (its forward, clean of rollout
noise: the log-probs of the policy update); the engine is whatever generated them (vLLM with
pushed weights, or any callable returning log-probs). A gap between the two is the train/rollout
mismatch that drives importance-ratio and KL blow-ups. `phase="rollout"` scores inside
`qtransform.rollout()` instead, which isolates the engine's own numerics from AQN's noise.

Per token, with lp_t the trainer's and lp_e the engine's log-prob of the sampled token and
r = lp_t - lp_e: |Δ| = |r|; per sequence (tokens summed, sampled from the engine) the KL(engine ||
trainer) estimators k1 = Σ -r and k3 = Σ (exp(r) - 1 - r) (Schulman's k3: unbiased, >= 0).
Greedy agreement compares the trainer's and the engine's greedy continuations position by position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from qtransform.core.io import encode_floats, write_json, write_text
from qtransform.core.phase import rollout
from qtransform.errors import UserError

LogProbs = Callable[[list[int], list[int]], Sequence[float]]


class Engine(Protocol):
    """A rollout engine seen by the parity report. `greedy` is optional."""

    def logprobs(self, prompt: list[int], completion: list[int]) -> Sequence[float]: ...


@dataclass
class ParityReport:
    """Per-token gaps between trainer and engine log-probs, summarized (all floats are float64)."""

    phase: str
    tokens: int
    mean_abs_delta: float
    max_abs_delta: float
    k1: list[float]  # per sequence
    k3: list[float]
    greedy_agreement: float | None  # fraction of positions where the greedy tokens agree
    first_divergence: list[int | None] | None  # per prompt: first position that differs
    largest: list[dict[str, Any]]  # the tokens where |Δ| is largest
    deltas: list[list[float]] = field(repr=False)  # per sequence, per token: lp_e - lp_t

    @property
    def mean_k1(self) -> float:
        return sum(self.k1) / len(self.k1)

    @property
    def mean_k3(self) -> float:
        return sum(self.k3) / len(self.k3)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(mean_k1=self.mean_k1, mean_k3=self.mean_k3)
        return out

    def markdown(self) -> str:
        agree = ("n/a (the engine has no greedy decoding)" if self.greedy_agreement is None
                 else f"{self.greedy_agreement:.4f}")
        lines = [
            "# Rollout/trainer parity", "",
            f"Trainer log-probs scored in the `{self.phase}` phase; {self.tokens} completion tokens "
            f"in {len(self.k1)} sequences.", "",
            "| metric | value |", "|---|---|",
            f"| mean abs Δ log-prob | {self.mean_abs_delta:.3e} |",
            f"| max abs Δ log-prob | {self.max_abs_delta:.3e} |",
            f"| mean k1 per sequence (KL engine‖trainer) | {self.mean_k1:.3e} |",
            f"| mean k3 per sequence | {self.mean_k3:.3e} |",
            f"| greedy token agreement | {agree} |", "",
            "## Largest gaps", "",
            "| sequence | position | token | trainer | engine | Δ |", "|---|---|---|---|---|---|",
        ]
        lines += [f"| {t['sequence']} | {t['position']} | {t['token']} | {t['trainer']:.6f} | "
                  f"{t['engine']:.6f} | {t['delta']:+.3e} |" for t in self.largest]
        return "\n".join(lines) + "\n"

    def write(self, folder: str | Path) -> dict[str, Path]:
        """parity.json, parity.md and parity.png (histogram of |Δ|) in `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        paths = {"json": write_json(folder / "parity.json", encode_floats(self.to_dict())),
                 "markdown": write_text(folder / "parity.md", self.markdown()),
                 "png": folder / "parity.png"}
        self._histogram(paths["png"])
        return paths

    def _histogram(self, path: Path) -> None:
        import matplotlib  # loaded only when a figure is drawn (0.5 s)

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        gaps = [abs(d) for seq in self.deltas for d in seq]
        floor = 1e-12
        logs = [math.log10(max(g, floor)) for g in gaps]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(logs, bins=40, color="#4c72b0")
        ax.set_xlabel("log10 |Δ log-prob| (trainer vs engine; exact zeros at -12)")
        ax.set_ylabel("tokens")
        ax.set_title(f"parity: mean |Δ| {self.mean_abs_delta:.2e}, max {self.max_abs_delta:.2e}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def hf_logprobs(model: nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """Log-probs of `completion` after `prompt` under a HF causal LM (one forward, float64 softmax)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion).unsqueeze(-1))
    return lp.squeeze(-1).tolist()


def hf_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a HF causal LM (its `generate`: a rollout for a transformed model)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class HFEngine:
    """A plain HF model as an engine (e.g. the original architecture loaded with rollout_weights)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        return hf_logprobs(self.model, prompt, completion)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return hf_greedy(self.model, prompt, n)


def _sample(model: nn.Module, prompts: list[list[int]], n: int, seed: int) -> list[list[int]]:
    torch.manual_seed(seed)
    return [model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=True,
                           top_k=0, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def parity(model: nn.Module, engine: Engine | LogProbs, prompts: list[list[int]],
           completions: list[list[int]] | None = None, *, max_new_tokens: int = 16,
           phase: str = "train", top: int = 10, seed: int = 0) -> ParityReport:
    """Compare the trainer's per-token log-probs (the transformed `model`) with `engine`'s.

    Completions are given, or sampled from `engine.sample(prompt, n)` when it has one, else from
    the model's rollout (`generate`, seeded). `phase` is "train" (the policy update's forward) or
    "rollout" (the rollout's own forward, noise included)."""
    if phase not in ("train", "rollout"):
        raise UserError(f"phase must be 'train' or 'rollout', got {phase!r}")
    if not prompts or any(not p for p in prompts):
        raise UserError("parity needs at least one prompt, and no empty prompt")
    score = engine if callable(engine) and not hasattr(engine, "logprobs") else engine.logprobs
    if completions is None:
        sample = getattr(engine, "sample", None)
        completions = ([list(sample(p, max_new_tokens)) for p in prompts] if sample
                       else _sample(model, prompts, max_new_tokens, seed))
    if len(completions) != len(prompts):
        raise UserError(f"{len(prompts)} prompts but {len(completions)} completions")
    deltas, k1, k3, rows = [], [], [], []
    for s, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if phase == "rollout":
            with rollout():
                trainer = hf_logprobs(model, prompt, completion)
        else:
            trainer = hf_logprobs(model, prompt, completion)
        got = [float(v) for v in score(prompt, completion)]
        if len(got) != len(completion):
            raise UserError(f"the engine returned {len(got)} log-probs for {len(completion)} tokens")
        seq = [e - t for e, t in zip(got, trainer, strict=True)]
        deltas.append(seq)
        k1.append(sum(seq))  # -r summed, r = lp_t - lp_e
        k3.append(sum(math.expm1(-d) + d for d in seq))
        rows += [{"sequence": s, "position": i, "token": tok, "trainer": t, "engine": e, "delta": e - t}
                 for i, (tok, t, e) in enumerate(zip(completion, trainer, got, strict=True))]
    gaps = [abs(d) for seq in deltas for d in seq]
    if not gaps:
        raise UserError("the completions are empty: give max_new_tokens >= 1")
    agreement, divergence = _greedy_agreement(model, engine, prompts, max_new_tokens)
    return ParityReport(
        phase=phase, tokens=len(gaps), mean_abs_delta=math.fsum(gaps) / len(gaps),
        max_abs_delta=max(gaps), k1=k1, k3=k3, greedy_agreement=agreement,
        first_divergence=divergence,
        largest=sorted(rows, key=lambda r: -abs(r["delta"]))[:top], deltas=deltas,
    )


def _greedy_agreement(model: nn.Module, engine: Any, prompts: list[list[int]],
                      n: int) -> tuple[float | None, list[int | None] | None]:
    greedy = getattr(engine, "greedy", None)
    if greedy is None:
        return None, None
    same = total = 0
    first: list[int | None] = []
    for prompt in prompts:
        mine, theirs = hf_greedy(model, prompt, n), list(greedy(prompt, n))
        pairs = list(zip(mine, theirs, strict=False))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
        first.append(next((i for i, (a, b) in enumerate(pairs) if a != b), None))
    return same / total, first
