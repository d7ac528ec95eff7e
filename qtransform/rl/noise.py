"""The noise controller: one handle on a transformed model's AQN modules (step, sigma, on/off).

The state lives in the inserted modules, so every controller built on the same model agrees, and
a checkpoint of the controller restores the exact noise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

from qtransform.errors import UserError
from qtransform.passes.aqn_noise import AQNNoise
from qtransform.schemas import Schedule


class NoiseController:
    """Drives the AQN modules of one transformed model: the step, the schedule and switches.

    Call `step()` once per optimizer step. The state lives in the modules; this object is a view.
    """

    def __init__(self, modules: dict[str, AQNNoise]):
        if not modules:
            raise UserError(
                "the model has no AQN noise modules: transform it with a policy that has a "
                "'noise' section"
            )
        self.modules = modules
        first = next(iter(modules.values()))
        self.config = first.config

    @property
    def current_step(self) -> int:
        return next(iter(self.modules.values())).step_index

    @property
    def schedule(self) -> Schedule:
        return self.config.schedule

    def set_step(self, step: int) -> None:
        """Jump to a step: sigma follows the schedule and each site's draw is redone."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for module in self.modules.values():
            module.set_step(step)

    def step(self) -> None:
        """Advance one step (resampling z when resample == "step")."""
        self.set_step(self.current_step + 1)

    def sigma(self) -> dict[str, float]:
        """Site -> current effective sigma (sigma_t times the site's multiplier)."""
        return {site: m.sigma for site, m in self.modules.items()}

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Noise off inside the block: outputs are exactly those of the noise-free model."""
        before = {site: m.enabled for site, m in self.modules.items()}
        for module in self.modules.values():
            module.enabled = False
        try:
            yield
        finally:
            for site, module in self.modules.items():
                module.enabled = before[site]

    def state_dict(self) -> dict[str, Any]:
        """Step and per-site generator states: enough to resume the exact noise sequence."""
        return {
            "step": self.current_step,
            "seed": self.config.seed,
            "generators": {site: m.generator_state() for site, m in self.modules.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.modules) - set(state["generators"]))
        extra = sorted(set(state["generators"]) - set(self.modules))
        if missing or extra or state["seed"] != self.config.seed:
            raise UserError(
                f"noise state does not fit this model (missing sites {missing[:3]}, unknown "
                f"sites {extra[:3]}, seed {state['seed']} vs {self.config.seed})"
            )
        self.set_step(int(state["step"]))
        for site, module in self.modules.items():
            module.load_generator_state(state["generators"][site])


def noise_controller(model: nn.Module) -> NoiseController:
    """The controller of a transformed model's AQN noise (found by walking its modules)."""
    return NoiseController({m.site: m for m in model.modules() if isinstance(m, AQNNoise)})
