"""The noise controller: one handle on a transformed model's noise (step, sigma, on/off, counts).

The state lives in the inserted modules, so every controller built on the same model agrees, and
a checkpoint of the controller restores the exact noise. Stepping drives every random stream of
the model (AQN, hardware error, stochastic rounding), so each draw is a function of
(seed, step, site) and ranks that step together draw the same noise.

Every inserted noise module is a `core.noise.NoiseModule`, so the controller finds, steps and
switches off the modules of any noise pass, including passes added after it was written.

`evaluation(model)` is the model as deployed: noise off, fake quantization kept.

A run that configured AQN and never applied it (the controller never stepped past the noise-free
first interval; no forward in the noise's phase) ends with a warning that says why.
"""

from __future__ import annotations

import atexit
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from qtransform.core.backward import BackwardLinear
from qtransform.core.noise import LIVE_NOISE, NOISE_MODULES, NoiseCounts, NoiseModule, noise_modules
from qtransform.core.phase import rollout
from qtransform.core.schedule import sigma_at
from qtransform.core.streams import STREAM_VERSION
from qtransform.errors import UserError
from qtransform.passes import AQNNoise, AQNNoisePass, FakeQuantize
from qtransform.pipeline import registered_passes
from qtransform.schemas import Schedule


class NoiseController:
    """Drives the noise of one transformed model: the step, the schedule and switches.

    Call `step()` once per optimizer step. The state lives in the modules; this object is a view.
    `noise` holds every noise module (`core.noise.NoiseModule`: AQN, hardware error, activation
    noise, whatever pass inserted it); `modules` the AQN ones by site (their schedule and sigma);
    `others` the stochastic-rounding fake-quants and backward roles (`core.backward`), whose
    streams are stepped too.
    """

    def __init__(self, noise: list[NoiseModule], others: list[nn.Module] | None = None):
        if not noise:
            raise UserError(
                "the model has no noise modules: transform it with a policy that has a noise "
                f"section ({', '.join(noise_sections())})"
            )
        self.noise = noise
        self.modules = {m.site: m for m in noise if m.noise_pass == AQNNoisePass.name}
        self.others = others or []

    @property
    def config(self) -> Any:
        if not self.modules:
            raise UserError("the model has no AQN noise (only other noise passes): no schedule")
        return next(iter(self.modules.values())).config

    @property
    def current_step(self) -> int:
        return self.noise[0].stream.step

    @property
    def schedule(self) -> Schedule:
        return self.config.schedule

    def _stepped(self) -> list[Any]:
        return [*self.noise, *(m for m in self.others if m.stream is not None)]

    def set_step(self, step: int) -> None:
        """Jump to a step: sigma follows the schedule and each site's draws are redone."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for module in self._stepped():
            module.set_step(step)

    def hold(self, step: int) -> None:
        """Fix the step for a one-shot run (a parity report, an evaluation): no training loop
        steps this controller, so the end-of-run check does not ask for `step()`."""
        self.set_step(step)
        for module in self.noise:
            module.counts.held = True

    def step(self) -> None:
        """Advance one step (resampling z when resample == "step")."""
        self.set_step(self.current_step + 1)

    def sigma(self) -> dict[str, float]:
        """Site -> current effective sigma (sigma_t times the site's multiplier)."""
        return {site: m.sigma for site, m in self.modules.items()}

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Every noise module off inside the block: outputs are exactly those of the noise-free
        model (fake quantization stays)."""
        before = [m.enabled for m in self.noise]
        for module in self.noise:
            module.enabled = False
        try:
            yield
        finally:
            for module, was in zip(self.noise, before, strict=True):
                module.enabled = was

    def report(self) -> dict[str, Any]:
        """How many forwards and rollout-weight syncs saw AQN noise, and at which sigma; under
        `passes`, the same counters for every noise pass of the model (registry order)."""
        counts = [m.counts for m in self.modules.values()]
        sigmas: dict[float, int] = {}
        for c in counts:
            for sigma, n in c.sigmas.items():
                sigmas[sigma] = sigmas.get(sigma, 0) + n
        return {
            "step": self.current_step,
            **_totals(counts),
            "sigma_calls": dict(sorted(sigmas.items(), reverse=True)),
            "silent": silent_reason(list(self.modules.values())),
            "passes": {name: {"modules": len(group), **_totals([m.counts for m in group])}
                       for name in NOISE_MODULES
                       if (group := [m for m in self.noise if m.noise_pass == name])},
        }

    def state_dict(self) -> dict[str, Any]:
        """Step and the draws taken in it per site: enough to resume the exact noise sequence."""
        streams = {m.stream.key: m.stream.count for m in self._stepped()}
        return {"step": self.current_step, "seed": self._seed(), "draws": streams,
                "stream_version": STREAM_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        draws = state["draws"]
        mine = {m.stream.key: m for m in self._stepped()}
        saved = state.get("stream_version", 1)  # states from before the key: version 1
        if saved != STREAM_VERSION and any(m.counter_draws for m in mine.values()):
            raise UserError(
                f"noise state saved with draw stream version {saved}; this qtransform draws "
                f"hardware error and Gaussian activation noise from version {STREAM_VERSION} "
                "(docs/noise.md, 'The Gaussian stream'): the resumed noise would differ. Resume "
                "with the qtransform that saved it, or start the noise sequence anew")
        missing, extra = sorted(set(mine) - set(draws)), sorted(set(draws) - set(mine))
        if missing or extra or state["seed"] != self._seed():
            raise UserError(
                f"noise state does not fit this model (missing sites {missing[:3]}, unknown "
                f"sites {extra[:3]}, seed {state['seed']} vs {self._seed()})"
            )
        for key, module in mine.items():
            module.set_step(int(state["step"]), int(draws[key]))

    def _seed(self) -> int | None:
        return self.config.seed if self.modules else None


def _totals(counts: list[NoiseCounts]) -> dict[str, int]:
    """Forwards and syncs of a group of modules (each module sees every forward: the maximum)."""
    keys = ("forwards", "noised_forwards", "syncs", "noised_syncs")
    return {key: max((getattr(c, key) for c in counts), default=0) for key in keys}


def noise_sections() -> list[str]:
    """The policy sections of the registered noise passes."""
    return [p.section for p in registered_passes() if p.name in NOISE_MODULES]


def noise_controller(model: nn.Module) -> NoiseController:
    """The controller of a transformed model's noise (found by walking its modules)."""
    stochastic = [m for m in model.modules()
                  if isinstance(m, (FakeQuantize, BackwardLinear)) and m.stream is not None]
    return NoiseController(noise_modules(model), stochastic)


@contextmanager
def evaluation(model: nn.Module) -> Iterator[None]:
    """Forwards and `generate()` of `model` as the deployed model computes them: every noise
    module off (AQN, hardware error, activation noise), fake quantization kept, and computed as
    the rollout engine computes (LoRA layers with their dense weight: `core/lora.py`). Use it for
    evaluation after or during training: `generate()` alone is a rollout, noised.

    Example::

        with qtransform.evaluation(model):
            answers = model.generate(prompts, do_sample=False)
    """
    noise = noise_modules(model)
    before = [m.enabled for m in noise]
    for module in noise:
        module.enabled = False
    try:
        with rollout():
            yield
    finally:
        for module, was in zip(noise, before, strict=True):
            module.enabled = was


def _first_noisy_step(schedule: Schedule) -> int | None:
    span = schedule.total_steps or schedule.steps_per_epoch * (schedule.epochs or 1)
    return next((t for t in range(span + 1) if sigma_at(t, schedule) > 0), None)


def silent_reason(modules: list[AQNNoise]) -> str | None:
    """Why AQN that ran never applied noise, in words; None when it did apply (or never ran)."""
    counts = [m.counts for m in modules]
    if not counts or any(c.noised_forwards or c.noised_syncs for c in counts):
        return None
    calls = max(c.forwards + c.syncs for c in counts)
    if calls == 0:
        return None
    config = modules[0].config
    if not any(c.at_noisy_steps for c in counts):
        if all(c.held for c in counts):
            return None  # a step chosen for a one-shot run, not a loop that forgot to step
        last = max(c.last_step for c in counts)
        first = _first_noisy_step(config.schedule)
        return (f"AQN never applied noise: the noise controller never went past step {last}, and "
                f"the schedule's first noisy step is {first} (interval 0 is noise-free); call "
                "qtransform.noise_controller(model).step() once per optimizer step")
    if not any(c.in_phase_at_noisy_steps for c in counts):
        where = ("generate(), `with qtransform.rollout():` or rollout_weights"
                 if config.apply_during == "rollout" else f"{config.apply_during} mode")
        n = max(c.at_noisy_steps for c in counts)
        return (f"AQN never applied noise: apply_during={config.apply_during!r}, and none of the "
                f"{n} forwards/syncs at noisy steps ran in that phase ({where})")
    return "AQN never applied noise: it was disabled (noise.disabled()) whenever it could apply"


def _warn_silent_at_exit() -> None:
    groups: dict[int, list[AQNNoise]] = {}
    for module in list(LIVE_NOISE):
        if module.noise_pass == AQNNoisePass.name:
            groups.setdefault(id(module.config), []).append(module)
    for modules in groups.values():
        reason = silent_reason(modules)
        if reason:
            warnings.warn(f"{reason} ({len(modules)} noised sites)", RuntimeWarning, stacklevel=1)


atexit.register(_warn_silent_at_exit)
