"""Noise schedules and seeding: pure functions of the step, shared by the noise passes.

The schedule math is QeRL's staged scheme, generalized: training is split into K equal intervals,
the first is noise-free and interval k >= 1 uses stage value v_{k-1}, so a run starts clean and
the noise decays in steps.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol


class ScheduleLike(Protocol):
    """The fields the schedule functions read: the policy's `noise.schedule` (validated there,
    once: `qtransform.schemas.Schedule`) is the one schedule type."""

    kind: str
    sigma_start: float
    sigma_end: float | None
    total_steps: int | None
    steps_per_epoch: int | None
    epochs: int | None
    warmup_steps: int

    @property
    def per_epoch(self) -> bool: ...

    @property
    def stages(self) -> int: ...


@functools.lru_cache(maxsize=64)
def stage_values(s: ScheduleLike) -> tuple[float, ...]:
    """v_0 .. v_{K-2}: the sigma of intervals 1 .. K-1 (interval 0 is noise-free); cached, as
    every site asks for the same schedule on every step."""
    k = s.stages
    fractions = [i / (k - 2) if k > 2 else 0.0 for i in range(k - 1)]
    start, end = s.sigma_start, s.sigma_end if s.sigma_end is not None else s.sigma_start
    if s.kind == "exponential":
        return tuple(start * (end / start) ** f for f in fractions)
    if s.kind == "linear":
        return tuple(start + (end - start) * f for f in fractions)
    if s.kind == "cosine":
        return tuple(end + (start - end) * (1 + math.cos(math.pi * f)) / 2 for f in fractions)
    return (start,) * (k - 1)


def stage_at(step: int, s: ScheduleLike) -> int | None:
    """The interval `step` falls in (0 .. K-1), or None during warm-up.

    Intervals are cut with integer arithmetic, stage = min(t * K // L, K - 1) for the schedule's
    clock t = step - warmup_steps and its length L, so boundaries never depend on float rounding.
    """
    t = step - s.warmup_steps
    if t < 0:
        return None
    k = s.stages
    if not s.per_epoch:
        return min(t * k // (s.total_steps - s.warmup_steps), k - 1)
    epoch, position = divmod(t, s.steps_per_epoch)
    if s.epochs is not None and epoch >= s.epochs:
        return k - 1
    return min(position * k // s.steps_per_epoch, k - 1)


def sigma_at(step: int, s: ScheduleLike) -> float:
    """sigma_t of the schedule at a (0-based) training step; 0 in warm-up and interval 0."""
    stage = stage_at(step, s)
    return 0.0 if not stage else stage_values(s)[stage - 1]
