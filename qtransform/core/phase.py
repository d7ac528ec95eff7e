"""When noise applies: the training phase of a forward.

`apply_during` says it per noise section: "train" and "eval" follow `module.training`, "both"
always applies, and "rollout" (QeRL's AQN semantics) applies only while a rollout is being
generated: inside `generate()` of a transformed model, inside `with qtransform.rollout():`, and in
`rollout_weights`. The training loss, log-probs of the policy update and a reference model are
ordinary forwards and never see rollout noise.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from qtransform.core import versions

PHASES = ("train", "eval", "both", "rollout")
_ROLLOUT: contextvars.ContextVar[bool] = contextvars.ContextVar("qtransform_rollout", default=False)
_SYNC: contextvars.ContextVar[bool] = contextvars.ContextVar("qtransform_sync", default=False)


@contextmanager
def rollout() -> Iterator[None]:
    """Forwards inside this block are rollout forwards (noise with apply_during="rollout").

    Its first forward compares a sample of every cached weight (`versions.recheck`: one
    element per row), the forwards after it only the weights' identity and version counters,
    so its decode steps cost no reading of the weights (docs/rl.md: which writes are seen
    when)."""
    versions.recheck()
    token = _ROLLOUT.set(True)
    try:
        yield
    finally:
        _ROLLOUT.reset(token)
        versions.recheck()  # what was armed for the block ends with it (core/shortcut.py)


def in_rollout() -> bool:
    return _ROLLOUT.get()


@contextmanager
def syncing() -> Iterator[None]:
    """A rollout-weights sync: a rollout, counted as a sync rather than a forward."""
    token = _SYNC.set(True)
    try:
        with rollout():
            yield
    finally:
        _SYNC.reset(token)


def in_sync() -> bool:
    return _SYNC.get()


def active(phase: str, training: bool) -> bool:
    """Whether noise of `apply_during=phase` applies to a forward in this state."""
    if phase == "rollout":
        return in_rollout()
    return phase == "both" or (phase == "train") == training


class RolloutGenerate:
    """A transformed model's `generate`: the class's own, run as a rollout (see `rollout`).

    Kept in the model's `__dict__` (an instance attribute), so the model keeps its class; an
    object rather than a closure so that the model still pickles and deep-copies."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args: object, **kwargs: object) -> Any:
        with rollout():
            return type(self.model).generate(self.model, *args, **kwargs)


def mark_rollout_generate(model: nn.Module) -> None:
    """Make `model.generate(...)` a rollout, if the model generates at all."""
    if callable(getattr(type(model), "generate", None)):
        model.__dict__["generate"] = RolloutGenerate(model)
