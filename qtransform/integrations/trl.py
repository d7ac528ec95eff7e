"""TRL: a `TrainerCallback` that drives a transformed model's noise inside `GRPOTrainer` (or any
`transformers.Trainer`) and makes its rollouts see the rollout weights.

- The noise controller follows the trainer's optimizer step (`state.global_step`), so it is
  stepped once per optimizer step and resumes with the trainer.
- Sigma and the controller's counters go into the trainer's logs (`qtransform/...` keys).
- Rollouts: with `use_vllm=False` GRPOTrainer calls `model.generate()`, which is a rollout already
  (the transform marks it). With `use_vllm=True` (colocate or server) TRL streams the policy's
  parameters, LoRA merged, under Hugging Face names (`VLLMGeneration._iter_named_params`, read in
  trl 1.16.0); `attach` wraps that stream in `rollout_filter`, so vLLM loads the fake-quantized,
  AQN-noised weights and nothing is gathered twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from transformers import TrainerCallback

from qtransform.core.schedule import sigma_at
from qtransform.errors import UserError
from qtransform.rl import NoiseController, noise_controller, rollout_filter

PREFIX = "qtransform/"


def _controller(model: nn.Module) -> NoiseController | None:
    """The model's noise controller, or None for a policy without noise (quantization only)."""
    try:
        return noise_controller(model)
    except UserError:
        return None


class QTransformCallback(TrainerCallback):
    """Steps the noise with the optimizer and logs it. Add it with `attach(trainer)` (which also
    hooks TRL's vLLM weight sync), or pass it in `callbacks=[...]`."""

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.noise: NoiseController | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        target = self.model if self.model is not None else model
        if target is None:
            raise UserError("QTransformCallback needs the model: QTransformCallback(model)")
        self.noise = _controller(target)
        if self.noise is not None:
            self.noise.set_step(state.global_step)  # a resumed run continues the schedule

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.noise is not None:
            self.noise.set_step(state.global_step)  # once per optimizer step

    def metrics(self) -> dict[str, float]:
        """Scheduled sigma at the current step and the controller's counters (cumulative)."""
        if self.noise is None or not self.noise.modules:
            return {}
        report = self.noise.report()
        out = {f"{PREFIX}sigma": sigma_at(self.noise.current_step, self.noise.schedule),
               f"{PREFIX}step": float(report["step"])}
        for key in ("forwards", "noised_forwards", "syncs", "noised_syncs"):
            out[f"{PREFIX}{key}"] = float(report[key])
        return out

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        values = self.metrics()
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


def attach(trainer: Any) -> QTransformCallback:
    """Hook a transformed model into a TRL trainer: the callback (first, so reporters log its
    values) and, when the trainer generates with vLLM, the weight sync through `rollout_filter`."""
    callback = QTransformCallback(trainer.model)
    trainer.callback_handler.callbacks.insert(0, callback)
    generation = getattr(trainer, "vllm_generation", None)
    if getattr(trainer, "use_vllm", False) and generation is not None:
        if not hasattr(generation, "_iter_named_params"):
            raise UserError("this TRL version has no VLLMGeneration._iter_named_params to filter: "
                            "use trl 1.16 (qtransform[trl]) or push qtransform.rollout_weights yourself")
        if not isinstance(generation.__dict__.get("_iter_named_params"), _FilteredParams):
            generation._iter_named_params = _FilteredParams(trainer.model,
                                                            generation._iter_named_params)
    return callback
