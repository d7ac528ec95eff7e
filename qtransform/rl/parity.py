"""Rollout/trainer parity: how far a rollout engine's per-token log-probs drift from the trainer's.

The trainer scores completions with the transformed HF model (its forward, clean of rollout
noise: the log-probs of the policy update); the engine is whatever generated them (vLLM with
pushed weights, a plain HF model, or any callable returning log-probs). A gap between the two is
the train/rollout mismatch that drives importance-ratio and KL blow-ups. `phase="rollout"` scores
inside `qtransform.rollout()` instead, which isolates the engine's own numerics from AQN's noise.

Sampler replay: engines report the sampled token's log-prob under the processed distribution
(temperature, top-k, top-p, min-p; `rl/sampling.py`), so the trainer's logits go through the same
processing in the engine's order before the two are compared. A sampled token that the trainer's
processed distribution excludes (importance ratio 0) is counted in `outside_support` and left out
of the metrics, which would otherwise be infinite.

`metrics` are verl's rollout_corr metrics (`rl/mismatch.py`, the one home of the formulas). The
`floor` is the same metrics for the original model (every fake-quant and noise module switched
off) against the same engine and completions: what the engine's own numerics and the sampler
cost without qtransform; `gap` = metrics - floor is what the transform adds. `attribution`
switches one site on at a time (every other site off) and ranks sites by what that one site adds
to the floor's k3_kl.

Per sequence the report also keeps k1 = Σ(lp_e - lp_t) and k3 = Σ(exp(r) - 1 - r) with
r = lp_t - lp_e, and greedy agreement compares the trainer's and the engine's greedy
continuations position by position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from qtransform.core.noise import NoiseModule, noise_modules
from qtransform.core.phase import rollout
from qtransform.core.program import insertion_log
from qtransform.errors import UserError
from qtransform.models import source_tokenizer
from qtransform.passes import FakeQuantize
from qtransform.passes.fake_quant import HeadwiseQuantize
from qtransform.rl.mismatch import mismatch_metrics
from qtransform.rl.parity_report import ATTRIBUTION_KEY, ParityReport
from qtransform.rl.sampling import Sampling

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LogProbs = Callable[[list[int], list[int]], Sequence[float]]


class Engine(Protocol):
    """A rollout engine seen by the parity report: log-probs of given tokens under the processed
    distribution of `sampling`. Optional: `greedy(prompt, n)`, `sample(prompt, n, sampling)`
    returning (tokens, processed log-probs or None), `order` ("vllm" or "hf", the order of its
    sampler's steps; "vllm" when absent) and `describe()`."""

    def logprobs(self, prompt: list[int], completion: list[int],
                 sampling: Sampling) -> Sequence[float]: ...


def _warpers(sampling: Sampling) -> Any:
    """transformers' own logits processors for `sampling`, in generate's order."""
    import transformers as tf

    steps = []
    if sampling.temperature != 1.0:
        steps.append(tf.TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        steps.append(tf.TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        steps.append(tf.TopPLogitsWarper(top_p=sampling.top_p))
    if sampling.min_p > 0.0:
        steps.append(tf.MinPLogitsWarper(min_p=sampling.min_p))
    return tf.LogitsProcessorList(steps)


def _logits(model: nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """fp32 logits that predict each completion token (one forward over the whole sequence)."""
    with torch.no_grad():
        return model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()


def _gather(lp: torch.Tensor, completion: list[int]) -> list[float]:
    return lp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


class HFEngine:
    """A plain HF model as an engine (e.g. the original architecture loaded with rollout_weights).

    Log-probs come from one forward over the whole sequence (as vLLM's prefill), processed by
    transformers' own logits processors, so its sampler is generate's (`order = "hf"`)."""

    order = "hf"

    def __init__(self, model: nn.Module, name: str = "hf"):
        self.model = model
        self.name = name

    def describe(self) -> str:
        return f"{self.name} ({type(self.model).__name__})"

    def logprobs(self, prompt: list[int], completion: list[int],
                 sampling: Sampling | None = None) -> list[float]:
        scores = _logits(self.model, prompt, completion)
        if sampling is not None and not sampling.is_identity:
            scores = _warpers(sampling)(torch.zeros((len(completion), 1), dtype=torch.long), scores)
        return _gather(scores.double().log_softmax(-1), completion)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return hf_greedy(self.model, prompt, n)

    def sample(self, prompt: list[int], n: int, sampling: Sampling) -> tuple[list[int], None]:
        """Up to n tokens from generate with the sampler (the torch RNG, seeded by parity)."""
        return hf_sample(self.model, prompt, n, sampling), None


def hf_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of a HF causal LM (its `generate`: a rollout for a transformed model)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_sample(model: nn.Module, prompt: list[int], n: int, sampling: Sampling) -> list[int]:
    """Up to n tokens sampled by a HF causal LM's `generate` with `sampling`'s parameters. No
    minimum length: it would mask the end token out of the distribution sampled from, a step
    the scoring does not replay."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, pad_token_id=0,
                         **sampling.generate_kwargs())
    return out[0, len(prompt):].tolist()


def trainer_logprobs(model: nn.Module, prompt: list[int], completion: list[int],
                     sampling: Sampling, phase: str = "train") -> list[float]:
    """The trainer's processed log-probs of `completion` (float64), in the policy update's forward
    (`phase="train"`) or the rollout's (`"rollout"`: noise included)."""
    with rollout() if phase == "rollout" else nullcontext():
        logits = _logits(model, prompt, completion)
    return _gather(sampling.logprobs(logits), completion)


# -- the sites' switches (floor, attribution) -----------------------------------------------------
SWITCHED = (FakeQuantize, HeadwiseQuantize, NoiseModule)  # inserted modules parity switches


def site_switches(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Per site, the inserted modules that change values and can be switched off: fake quantization
    (an attention site's query/key/value/probs quantizers too, per head ones switched together)
    and noise (a clamp and an engine's attention kernel have no switch and stay)."""
    found: dict[str, list[nn.Module]] = {}
    for ins in insertion_log(model):
        module = model.get_submodule(ins.module_path)
        if isinstance(module, SWITCHED):
            found.setdefault(ins.site, []).append(module)
    return found


def site_points(model: nn.Module) -> dict[str, list[str]]:
    """Per site, the points (weight, input, key, value, ...) its switched modules act on."""
    found: dict[str, set[str]] = {}
    for ins in insertion_log(model):
        if isinstance(model.get_submodule(ins.module_path), SWITCHED):
            found.setdefault(ins.site, set()).add(ins.point)
    return {site: sorted(points) for site, points in found.items()}


@contextmanager
def only_sites(switches: dict[str, list[nn.Module]], sites: set[str]) -> Iterator[None]:
    """Inside the block only the modules of `sites` are on; each switch is restored after it."""
    modules = [m for group in switches.values() for m in group]
    before = [m.enabled for m in modules]
    for site, group in switches.items():
        for module in group:
            module.enabled = module.enabled and site in sites
    try:
        yield
    finally:
        for module, was in zip(modules, before, strict=True):
            module.enabled = was


def _padded(rows: list[list[float]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float64)


def compare(trainer: list[list[float]], engine: list[list[float]]) -> tuple[dict[str, float], int]:
    """verl's metrics over the tokens both sides can sample, and how many tokens one side excludes."""
    t, e = _padded(trainer), _padded(engine)
    real = _padded([[1.0] * len(r) for r in trainer]).bool()
    mask = real & t.isfinite() & e.isfinite()
    outside = int((real & ~mask).sum())
    if not mask.any():
        raise UserError("no sampled token is inside the trainer's processed distribution: its "
                        "top-k/top-p/min-p set misses every token the engine sampled")
    return mismatch_metrics(t.masked_fill(~mask, 0.0), e.masked_fill(~mask, 0.0), mask), outside


# -- the report -----------------------------------------------------------------------------------
def parity(model: nn.Module, engine: Engine | LogProbs, prompts: Sequence[list[int] | str],
           completions: list[list[int]] | None = None, *, max_new_tokens: int = 16,
           phase: str = "train", top: int = 10, seed: int = 0, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, floor: bool = True,
           attribute: bool = False, tokenizer: PreTrainedTokenizerBase | None = None,
           metadata: dict[str, Any] | None = None) -> ParityReport:
    """Compare the trainer's per-token log-probs (the transformed `model`) with `engine`'s.

    Args:
        engine: an `Engine` (`HFEngine`, `qtransform.integrations.vllm.VLLMEngine`) or a callable
            `engine(prompt_ids, completion_ids) -> log-probs` (processed by the sampler below).
        prompts: token-id lists, or texts encoded with `tokenizer` (default: the one beside the
            folder the model was loaded from).
        completions: given, or sampled by `engine.sample` when it has one, else by the model's
            rollout (`generate`), seeded with `seed`.
        phase: "train" (the policy update's forward) or "rollout" (the rollout's, noise included).
        temperature, top_k, top_p, min_p: the sampler; both sides are scored on its processed
            distribution (0 / 1.0 switch a filter off).
        floor: also score the original model (fake quantization and noise off) against the same
            engine: `floor` and `gap` in the report.
        attribute: rank the sites by what each alone adds to the floor (one forward per site and
            prompt).
        metadata: recorded in the report's `meta` beside what parity knows (model, engine,
            sampler, step, seed, version, date).

    Example:
        >>> served = AutoModelForCausalLM.from_config(config)
        >>> served.load_state_dict(dict(qtransform.rollout_weights(model)))
        >>> report = parity(model, HFEngine(served), ["What is 7 + 5?"], top_p=0.8, temperature=0.7)
        >>> report.metrics["kl"], report.gap["kl"]
    """
    if phase not in ("train", "rollout"):
        raise UserError(f"phase must be 'train' or 'rollout', got {phase!r}")
    sampling = Sampling(temperature, top_k, top_p, min_p, order=getattr(engine, "order", "vllm"))
    tokenizer, ids = _encode(model, prompts, tokenizer)
    completions, engine_lps = _rollouts(model, engine, ids, completions, max_new_tokens, sampling, seed)

    def scored() -> list[list[float]]:
        return [trainer_logprobs(model, p, c, sampling, phase) for p, c in zip(ids, completions, strict=True)]

    trainer = scored()
    metrics, outside = compare(trainer, engine_lps)
    switches = site_switches(model) if floor or attribute else {}
    floor_metrics: dict[str, float] | None = None
    ranked: list[dict[str, Any]] | None = None
    if switches:
        with only_sites(switches, set()):
            floor_metrics = compare(scored(), engine_lps)[0]
        if attribute:
            ranked = _attribution(switches, site_points(model), scored, engine_lps, floor_metrics)
    agreement, divergence = _greedy_agreement(model, engine, ids, max_new_tokens)
    meta = _meta(model, engine, sampling, phase, seed, max_new_tokens, metadata)
    return ParityReport.build(
        phase=phase, trainer=trainer, engine=engine_lps, prompts=ids, completions=completions,
        metrics=metrics, outside_support=outside, floor=floor_metrics, attribution=ranked,
        greedy_agreement=agreement, first_divergence=divergence, top=top, tokenizer=tokenizer,
        meta=meta)


def _rollouts(model: nn.Module, engine: Engine | LogProbs, ids: list[list[int]],
              completions: list[list[int]] | None, n: int, sampling: Sampling,
              seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """The completions (given, or sampled by the engine, else by the model's rollout) and the
    engine's processed log-probs of them (those it reported while sampling, else scored)."""
    sampled: list[Sequence[float] | None] = [None] * len(ids)
    if completions is None:
        torch.manual_seed(seed)
        sample = getattr(engine, "sample", None)
        if sample is not None:
            pairs = [sample(p, n, sampling) for p in ids]
            completions, sampled = [list(t) for t, _ in pairs], [lps for _, lps in pairs]
        else:
            completions = [hf_sample(model, p, n, sampling) for p in ids]
    if len(completions) != len(ids):
        raise UserError(f"{len(ids)} prompts but {len(completions)} completions")
    if not any(completions):
        raise UserError("the completions are empty: give max_new_tokens >= 1")
    plain = callable(engine) and not hasattr(engine, "logprobs")  # engine(prompt, completion)
    scored = []
    for prompt, completion, got in zip(ids, completions, sampled, strict=True):
        if got is None:
            got = engine(prompt, completion) if plain else engine.logprobs(prompt, completion, sampling)
        got = [float(v) for v in got]
        if len(got) != len(completion):
            raise UserError(f"the engine returned {len(got)} log-probs for {len(completion)} tokens")
        scored.append(got)
    return completions, scored


def _attribution(switches: dict[str, list[nn.Module]], points: dict[str, list[str]],
                 scored: Callable[[], list[list[float]]], engine_lps: list[list[float]],
                 floor: dict[str, float]) -> list[dict[str, Any]]:
    """One site on at a time (an attention site: its query/key/value/probs quantizers): its
    metrics and what it adds to the floor, largest first."""
    rows = []
    for site, modules in switches.items():
        with only_sites(switches, {site}):
            m = compare(scored(), engine_lps)[0]
        rows.append({"site": site, "modules": sorted({type(x).__name__ for x in modules}),
                     "points": points.get(site, []),
                     **{k: m[k] for k in ("kl", "k3_kl", "chi2_token", "log_ppl_abs_diff")},
                     "added": m[ATTRIBUTION_KEY] - floor[ATTRIBUTION_KEY]})
    rows.sort(key=lambda r: -r["added"])
    for rank, row in enumerate(rows, 1):
        row["rank"] = rank
    return rows


def _encode(model: nn.Module, prompts: Sequence[list[int] | str],
            tokenizer: PreTrainedTokenizerBase | None,
            ) -> tuple[PreTrainedTokenizerBase | None, list[list[int]]]:
    if not prompts:
        raise UserError("parity needs at least one prompt")
    texts = [p for p in prompts if isinstance(p, str)]
    if tokenizer is None:
        tokenizer = source_tokenizer(model)
    if texts and tokenizer is None:
        raise UserError("text prompts need a tokenizer: pass tokenizer=..., or load the model from "
                        "a folder that has one (or give token ids)")
    ids = [tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    if any(not p for p in ids):
        raise UserError("parity needs non-empty prompts (a text encoded to no token)")
    return tokenizer, ids


def _meta(model: nn.Module, engine: Engine | LogProbs, sampling: Sampling, phase: str, seed: int,
          max_new_tokens: int, extra: dict[str, Any] | None) -> dict[str, Any]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    noise = noise_modules(model)
    describe = getattr(engine, "describe", None)
    return {
        "model": str(getattr(getattr(base, "config", None), "_name_or_path", "") or type(base).__name__),
        "engine": describe() if describe else getattr(engine, "__name__", type(engine).__name__),
        "sampler": sampling.to_dict(), "phase": phase, "seed": seed,
        "max_new_tokens": max_new_tokens,
        "controller_step": noise[0].stream.step if noise else None,
        "qtransform_version": version("qtransform"), "torch_version": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }


def _greedy_agreement(model: nn.Module, engine: Engine | LogProbs, prompts: list[list[int]],
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
    return same / total if total else math.nan, first
