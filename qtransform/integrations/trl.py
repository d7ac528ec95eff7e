"""TRL: a `TrainerCallback` that drives a transformed model's noise inside `GRPOTrainer` (or any
`transformers.Trainer`), makes its rollouts see the rollout weights, records the rollouts'
log-probs, corrects the loss for them, and logs through the trainer's own reporters.

- The noise controller follows the trainer's optimizer step (`state.global_step`), so it is
  stepped once per optimizer step and resumes with the trainer.
- The logs (`qtransform/...` keys, docs/rl.md) carry the sigma the row's rollouts were generated
  at (not the controller's next one), the controller's counters, every `weight_stats_every`
  steps the fake-quant statistics of the weights, and with `attach` the mismatch metrics.
- Rollouts: with `use_vllm=False` GRPOTrainer calls `model.generate()`, which is a rollout already
  (the transform marks it). `attach` records the per-token log-probs that generate sampled from
  (the processed distribution: temperature, top-k, top-p applied) and hands them to TRL as the
  sampler's log-probs, the ones vLLM returns on the vLLM path. With `use_vllm=True` (colocate or
  server) TRL streams the policy's parameters, LoRA merged, under Hugging Face names
  (`VLLMGeneration._iter_named_params`, read in trl 1.16.0); `attach` wraps that stream in
  `rollout_filter`, so vLLM loads the weights the rollout computes with (a LoRA layer as
  quant(W) + s B A under the default `lora: "beside"`, quant(W + s B A) under `"merged"`; norms
  AQN-noised) and nothing is gathered twice.
- Correction (generate() path): the trainer's log-probs come from a noise-free no-grad forward
  (TRL's `old_per_token_logps`, computed as TRL does when it corrects vLLM rollouts), the weights
  from `qtransform.rl.Correction`, and the loss multiplies each token's term by its weight, as TRL
  multiplies by `importance_sampling_ratio` on the vLLM path (applied through the advantages:
  -min(c·A, clip(c)·A)·w = -min(c·A·w, clip(c)·A·w) for w >= 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import (
    LogitsProcessor,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from qtransform.core.schedule import sigma_at
from qtransform.errors import UserError
from qtransform.rl import (
    Correction,
    NoiseController,
    mismatch_metrics,
    noise_controller,
    rollout_filter,
)
from qtransform.rl.tracking import PREFIX, noise_metrics, weight_stats

if TYPE_CHECKING:
    from transformers import Trainer
    from trl import GRPOTrainer

# the correction's per-token factors in TRL's batch dict: a key of our own, so that TRL's own
# `importance_sampling_ratio` (vLLM path) is never applied twice
WEIGHTS = "qtransform_correction_weights"


def _controller(model: nn.Module) -> NoiseController | None:
    """The model's noise controller, or None for a policy without noise (quantization only)."""
    try:
        return noise_controller(model)
    except UserError:
        return None


class QTransformCallback(TrainerCallback):
    """Steps the noise with the optimizer and logs it. Add it with `attach(trainer)` (which also
    hooks TRL's vLLM weight sync and records the rollouts), or pass it in `callbacks=[...]`.

    `weight_stats_every`: every that many optimizer steps the next log row carries the weights'
    fake-quant statistics (0: never)."""

    def __init__(self, model: nn.Module | None = None, *, weight_stats_every: int = 50):
        if weight_stats_every < 0:
            raise UserError(f"weight_stats_every must be >= 0 (0: off), got {weight_stats_every}")
        self.model = model
        self.weight_stats_every = weight_stats_every
        self.noise: NoiseController | None = None
        self.rollout_sigma: float | None = None  # the sigma the latest rollouts were generated at
        self.records_rollouts = False  # set by attach: generation reports its own sigma
        self._pending: dict[str, float] = {}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, model: nn.Module | None = None,
                       **kwargs: object) -> None:
        target = self.model if self.model is not None else model
        if target is None:
            raise UserError("QTransformCallback needs the model: QTransformCallback(model)")
        self.model = target
        self.noise = _controller(target)
        if self.noise is not None:
            self.noise.set_step(state.global_step)  # a resumed run continues the schedule

    def rollouts_generated(self) -> None:
        """Note the sigma of rollouts being generated now (their log row reports it)."""
        if self.noise is not None and self.noise.modules:
            self.rollout_sigma = sigma_at(self.noise.current_step, self.noise.schedule)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        if not self.records_rollouts:  # without attach: the step's rollouts use this step's sigma
            self.rollouts_generated()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object) -> None:
        if self.noise is not None:
            self.noise.set_step(state.global_step)  # once per optimizer step
        every = self.weight_stats_every
        if every and self.model is not None and state.global_step % every == 0:
            self._pending = weight_stats(self.model)

    def metrics(self) -> dict[str, float]:
        """Sigma of the latest rollouts, the controller's counters (cumulative) and weight
        statistics measured since the last log."""
        return {**noise_metrics(self.noise, self.rollout_sigma), **self._pending}

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict | None = None,
               **kwargs: object) -> None:
        values = self.metrics()
        self._pending = {}
        if logs is not None:
            logs.update(values)  # what the reporters after this callback see
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # Trainer.log copied `logs` before the callbacks


class _FilteredParams:
    """TRL's parameter stream for vLLM, passed through `rollout_filter` (an object, not a closure,
    so the trainer still pickles)."""

    def __init__(self, model: nn.Module, source: Callable[[], Iterator[tuple[str, Tensor]]]):
        self.model = model
        self.source = source

    def __call__(self) -> Iterator[tuple[str, Tensor]]:
        return rollout_filter(self.model, self.source())


class _SampledLogProbs(LogitsProcessor):
    """Last in generate's processor list: sees the scores the sampler draws from and keeps the
    log-prob of each sampled token (read at the next step, when the token is in `input_ids`)."""

    def __init__(self) -> None:
        self.steps: list[Tensor] = []
        self.pending: Tensor | None = None

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def per_sequence(self, completions: list[list[int]]) -> list[list[float]]:
        """Each completion's sampled log-probs (generate may run steps past the returned ones)."""
        done = torch.stack(self.steps, dim=1).tolist() if self.steps else [[] for _ in completions]
        out = []
        for row, (ids, lps) in enumerate(zip(completions, done, strict=True)):
            lps = lps[: len(ids)]
            if len(ids) > len(lps) and self.pending is not None:  # the token of the last step
                lps.append(float(self.pending[row, ids[len(lps)]]))
            out.append(lps)
        return out


class _AppendProcessor:
    """Stands in for the model's `_get_logits_processor` during one generate: the model's own
    list, with the recorder appended after every warper."""

    def __init__(self, model: nn.Module, recorder: _SampledLogProbs):
        self.model, self.recorder, self.calls = model, recorder, 0

    def __call__(self, *args: object, **kwargs: object) -> Any:
        self.calls += 1
        if self.calls > 1:
            raise UserError("one rollout batch ran generate() twice: qtransform's recorder expects one")
        processors = type(self.model)._get_logits_processor(self.model, *args, **kwargs)
        processors.append(self.recorder)
        return processors


class _Generation:
    """Wraps GRPOTrainer._generate_single_turn: notes the rollouts' sigma and, on the generate()
    path, returns the sampled log-probs where TRL's own code returns None."""

    def __init__(self, trainer: GRPOTrainer, callback: QTransformCallback, original: Callable[..., Any]):
        self.trainer, self.callback, self.original = trainer, callback, original

    def __call__(self, *args: object, **kwargs: object) -> Any:
        self.callback.rollouts_generated()
        trainer = self.trainer
        if trainer.use_vllm or getattr(trainer, "use_transformers_continuous_batching", False):
            return self.original(*args, **kwargs)
        model = _generating_model(trainer.model)
        recorder = _SampledLogProbs()
        model.__dict__["_get_logits_processor"] = _AppendProcessor(model, recorder)
        try:
            completion_ids, logprobs = self.original(*args, **kwargs)
        finally:
            del model.__dict__["_get_logits_processor"]
        if logprobs is None:
            logprobs = recorder.per_sequence(completion_ids)
        return completion_ids, logprobs


def _generating_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model whose GenerationMixin.generate runs (inside a PEFT wrapper)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not hasattr(type(inner), "_get_logits_processor"):
        raise UserError(f"{type(inner).__name__} has no GenerationMixin._get_logits_processor to "
                        "record rollout log-probs from: use transformers >= 4.45 (qtransform[trl])")
    return inner


class _Scoring:
    """Wraps GRPOTrainer._generate_and_score_completions: the mismatch metrics of the recorded
    rollout log-probs against the trainer's, and the correction's weights for the loss."""

    def __init__(self, trainer: GRPOTrainer, correction: Correction | None, metrics: bool,
                 original: Callable[..., Any]):
        self.trainer, self.correction, self.metrics, self.original = trainer, correction, metrics, original

    def __call__(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.original(inputs)
        trainer = self.trainer
        rollout = out.get("sampling_per_token_logps")
        if trainer.use_vllm or rollout is None or (self.correction is None and not self.metrics):
            return out
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        policy = out.get("old_per_token_logps")
        if policy is None:
            policy = self._trainer_logps(out)
        mode = "train" if trainer.model.training else "eval"
        if self.metrics and mask.any():
            for key, value in mismatch_metrics(policy, rollout, mask).items():
                trainer._metrics[mode][f"{PREFIX}mismatch/{key}"].append(value)
        if self.correction is not None:
            weights = self.correction.weights(policy, rollout, mask)
            out["old_per_token_logps"] = policy  # PPO's old policy: the trainer's, as TRL on vLLM
            out[WEIGHTS] = weights
            real = mask.bool()
            trainer._metrics[mode][f"{PREFIX}correction/mean_weight"].append(float(weights[real].mean()))
            trainer._metrics[mode][f"{PREFIX}correction/zeroed_fraction"].append(
                float((weights[real] == 0).double().mean()))
        return out

    def _trainer_logps(self, out: dict[str, Any]) -> Tensor:
        """The trainer's log-probs of the sampled tokens: a no-grad forward outside any rollout."""
        trainer = self.trainer
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        mode = "train" if trainer.model.training else "eval"
        batch = trainer.args.per_device_train_batch_size if mode == "train" else trainer.args.per_device_eval_batch_size
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, out["completion_ids"].size(1), batch_size=batch)
        return logps


class _CorrectedLoss:
    """Wraps GRPOTrainer._compute_loss: each token's loss term times its correction weight."""

    def __init__(self, original: Callable[..., Any]):
        self.original = original

    def __call__(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        weights = inputs.get(WEIGHTS)
        if weights is not None:
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            inputs = {**inputs, "advantages": advantages * weights}
        return self.original(model, inputs)


def attach(trainer: Trainer, *, correction: Correction | None = None, mismatch: bool = True,
           weight_stats_every: int = 50) -> QTransformCallback:
    """Hook a transformed model into a TRL trainer: the callback (first, so reporters log its
    values); with vLLM the weight sync through `rollout_filter`; with generate() the rollouts'
    log-probs, the mismatch metrics (`mismatch=False` saves the no-grad trainer forward they
    need when TRL computes none) and, given a `Correction`, the corrected loss."""
    callback = QTransformCallback(trainer.model, weight_stats_every=weight_stats_every)
    trainer.callback_handler.callbacks.insert(0, callback)
    use_vllm = getattr(trainer, "use_vllm", False)
    generation = getattr(trainer, "vllm_generation", None)
    if use_vllm and generation is not None:
        if not hasattr(generation, "_iter_named_params"):
            raise UserError("this TRL version has no VLLMGeneration._iter_named_params to filter: "
                            "use trl 1.16 (qtransform[trl]) or push qtransform.rollout_weights yourself")
        if not isinstance(generation.__dict__.get("_iter_named_params"), _FilteredParams):
            generation._iter_named_params = _FilteredParams(trainer.model,
                                                            generation._iter_named_params)
    if correction is not None and use_vllm:
        raise UserError("with use_vllm=True correct with TRL's own vllm_importance_sampling_correction "
                        "(GRPOConfig); qtransform's Correction is for the generate() path")
    if correction is not None and getattr(trainer, "loss_type", None) == "vespo":
        raise UserError("the vespo loss weights sequences itself: use another loss_type with a Correction")
    if not hasattr(trainer, "_generate_single_turn"):  # not a GRPOTrainer: noise and logs only
        if correction is not None:
            raise UserError(f"a Correction needs TRL's GRPOTrainer, got {type(trainer).__name__}")
        return callback
    if not isinstance(trainer.__dict__.get("_generate_single_turn"), _Generation):
        callback.records_rollouts = True
        trainer._generate_single_turn = _Generation(trainer, callback, trainer._generate_single_turn)
        trainer._generate_and_score_completions = _Scoring(trainer, correction, mismatch,
                                                           trainer._generate_and_score_completions)
        trainer._compute_loss = _CorrectedLoss(trainer._compute_loss)
    return callback
