"""Noise schedules and seeding: pure functions of the step, shared by the noise passes.

The schedule math is QeRL's staged scheme, generalized: training is split into K equal intervals,
the first is noise-free and interval k >= 1 uses stage value v_{k-1}, so a run starts clean and
the noise decays in steps. The controller owns nothing but a view of the inserted `AQNNoise`
modules: the step, sigma and draws live in the modules, so every controller built on the same
model agrees, and a checkpoint of the controller restores the exact noise.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from qtransform.errors import UserError

KINDS = ("exponential", "linear", "cosine", "constant")
DEFAULT_STAGES = 10


@dataclass(frozen=True)
class Schedule:
    """A sigma schedule; `total_steps` XOR (`steps_per_epoch` + `stages_per_epoch`).

    Total form: K = `num_stages` intervals spread over steps [warmup_steps, total_steps).
    Per-epoch form: every epoch of `steps_per_epoch` steps runs the whole schedule again in
    K = `stages_per_epoch` intervals; with `epochs` set, the last value holds after that many.
    """

    kind: str
    sigma_start: float
    sigma_end: float | None = None
    num_stages: int | None = None
    total_steps: int | None = None
    steps_per_epoch: int | None = None
    stages_per_epoch: int | None = None
    epochs: int | None = None
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise UserError(f"noise.schedule: {problem}")

    @property
    def per_epoch(self) -> bool:
        return self.steps_per_epoch is not None

    @property
    def stages(self) -> int:
        """K: the number of intervals one run of the schedule is split into."""
        if self.per_epoch:
            return self.stages_per_epoch or 0
        return self.num_stages if self.num_stages is not None else DEFAULT_STAGES

    @classmethod
    def from_spec(cls, spec: Any) -> Schedule:
        """From the policy's `noise.schedule` (or any object with the same fields)."""
        names = [f for f in cls.__dataclass_fields__ if hasattr(spec, f)]
        return cls(**{f: getattr(spec, f) for f in names})


def _problem(s: Schedule) -> str:
    """What is wrong with a schedule ('' when nothing): the schema checks the same for policies,
    this guards direct users of the pure functions."""
    if s.kind not in KINDS:
        return f"unknown kind {s.kind!r}; allowed: {', '.join(KINDS)}"
    if s.per_epoch == (s.total_steps is not None) or s.per_epoch != (s.stages_per_epoch is not None):
        return "give total_steps, or steps_per_epoch and stages_per_epoch"
    span = s.steps_per_epoch * (s.epochs or 1) if s.per_epoch else s.total_steps
    if s.stages < 2 or s.warmup_steps < 0 or s.warmup_steps >= span:
        return f"needs >= 2 stages and 0 <= warmup_steps < {span}"
    if s.kind != "constant" and s.sigma_end is None:
        return f"sigma_end is required by a {s.kind} schedule"
    if s.sigma_start < 0 or (s.sigma_end or 0) < 0:
        return "sigmas must be >= 0"
    if s.kind == "exponential" and (s.stages < 3 or not s.sigma_end or s.sigma_start <= 0):
        return "exponential needs >= 3 stages and sigma_start, sigma_end > 0"
    return ""


@functools.lru_cache(maxsize=64)
def stage_values(s: Schedule) -> tuple[float, ...]:
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


def stage_at(step: int, s: Schedule) -> int | None:
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


def sigma_at(step: int, s: Schedule) -> float:
    """sigma_t of the schedule at a (0-based) training step; 0 in warm-up and interval 0."""
    stage = stage_at(step, s)
    return 0.0 if not stage else stage_values(s)[stage - 1]


def active_in(phase: str, training: bool) -> bool:
    """Whether noise applies in this phase: "train" (module.training), "eval" or "both"."""
    return phase == "both" or (phase == "train") == training


def site_seed(seed: int, site: str, step: int) -> int:
    """The generator seed of one site at one step: a stable 63-bit hash, so the draw depends on
    (seed, site, step) only and sites get independent streams."""
    digest = hashlib.blake2b(f"{seed}/{site}/{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_normal(shape: torch.Size, generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Standard normal draw in fp32 from `generator`, cast to `like`'s dtype on its device."""
    z = torch.randn(shape, generator=generator, device=like.device, dtype=torch.float32)
    return z.to(like.dtype)
