"""AQN pass: QeRL's Adaptive Quantization Noise as a node on norm (or linear) weights.

The weight a site computes with becomes gamma + sigma_t * m_site * z. The parameter is never
written: the noise is an inserted module on the site's weight, so it cannot accumulate across
steps (the bug of in-place `weight.add_(noise)` implementations) and switching it off gives the
clean model back bit for bit. The schedule and the controller live in `qtransform.noise`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core import ops
from qtransform.core.program import Program
from qtransform.core.schedule import Schedule, active_in, draw_normal, sigma_at, site_seed
from qtransform.core.sites import Site
from qtransform.errors import UserError
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas import NoiseSpec
from qtransform.schemas.selectors import format_layers

NOISE_KINDS = ("norm", "linear", "conv1d")


@dataclass(frozen=True)
class NoiseConfig:
    """What every AQN module of one transform shares."""

    schedule: Schedule
    resample: str  # "step": one draw per step; "forward": a fresh draw every forward
    apply_during: str  # "train" | "eval" | "both", checked against module.training
    seed: int


class AQNNoise(nn.Module):
    """Adds sigma * z to the weight it receives; z and sigma are state, never parameters.

    z is a non-persistent buffer (it follows `.to(device)` but stays out of `state_dict()`),
    drawn in fp32 from a generator seeded by (seed, site, step) and cast to the weight's dtype.
    `noise_override`, when set, is used as z instead (the ONNX exporter feeds a graph input).
    """

    def __init__(self, site: str, multiplier: float, config: NoiseConfig, weight: Tensor):
        super().__init__()
        self.site = site
        self.label = f"{site}/weight_noise"
        self.multiplier = multiplier
        self.config = config
        self.enabled = True
        self.noise_override: Tensor | None = None
        self.step_index = 0
        self.sigma = 0.0
        self._generator: torch.Generator | None = None
        self.register_buffer("z", torch.zeros_like(weight), persistent=False)
        self.set_step(0)

    def extra_repr(self) -> str:
        return f"label={self.label!r}, multiplier={self.multiplier:g}, step={self.step_index}, sigma={self.sigma:.3g}"

    def _generator_on(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(site_seed(self.config.seed, self.site, self.step_index))
        return self._generator

    @torch.no_grad()
    def set_step(self, step: int) -> None:
        """Sigma for `step` from the schedule, generator reseeded, z redrawn for the step."""
        self.step_index = step
        self.sigma = sigma_at(step, self.config.schedule) * self.multiplier
        generator = self._generator_on(self.z.device)
        generator.manual_seed(site_seed(self.config.seed, self.site, step))
        self.z.copy_(torch.randn(self.z.shape, generator=generator, device=self.z.device, dtype=torch.float32))

    def generator_state(self) -> dict[str, Any]:
        generator = self._generator_on(self.z.device)
        return {"device": str(generator.device), "state": generator.get_state()}

    def load_generator_state(self, state: dict[str, Any]) -> None:
        """Restore the position inside a step (matters for resample="forward"); a state saved
        on another device type cannot be replayed here, so the step's seed stands."""
        generator = self._generator_on(self.z.device)
        if state["device"] == str(generator.device):
            generator.set_state(state["state"])

    def forward(self, weight: Tensor) -> Tensor:
        active = self.enabled and active_in(self.config.apply_during, self.training)
        scale = self.sigma if active else 0.0
        z = self.noise_override
        if ops.is_tracing(weight):
            return torch.ops.qtransform.noise(weight, self.z if z is None else z, scale, "add", self.label)
        if scale == 0.0:
            return weight
        if z is None:
            forward_draw = self.config.resample == "forward"
            z = draw_normal(weight.shape, self._generator_on(weight.device), weight) if forward_draw else self.z
        return weight + scale * z.to(weight.dtype)


def _selection(section: Any) -> SimpleNamespace:
    """The selector fields of a policy entry, as `select_sites` reads them."""
    return SimpleNamespace(targets=list(section.targets), ignore=list(section.ignore), layers=section.layers)


def site_multipliers(program: Program, spec: Any, sites: list[Site]) -> dict[str, tuple[float, list[str]]]:
    """Site -> (m_site, reasons). m_site = layer_multipliers[layer] times the value of every
    matching `multipliers` entry (matches multiply). Entries that reach no noised site are
    errors, as a multiplier that silently does nothing is a wrong experiment."""
    noised = {s.name for s in sites}
    layers = {s.layer for s in sites if s.layer is not None}
    for layer in spec.layer_multipliers:
        if layer not in layers:
            raise UserError(
                f"noise.layer_multipliers: layer {layer} has no noised site; noised layers: "
                f"{format_layers(layers) or 'none'}"
            )
    hits: list[set[str]] = []
    for i, mult in enumerate(spec.multipliers):
        where = f"noise.multipliers[{i}]"
        matched = {s.name for s in select_sites(program, _selection(mult), where, kinds=NOISE_KINDS)}
        if not matched & noised:
            raise UserError(f"{where}: matches only sites the noise section does not select "
                            f"(e.g. {sorted(matched)[0]})")
        hits.append(matched)
    out: dict[str, tuple[float, list[str]]] = {}
    for site in sites:
        factor, why = 1.0, []
        if site.layer in spec.layer_multipliers:
            value = spec.layer_multipliers[site.layer]
            factor *= value
            why.append(f"layer {site.layer} x{value:g}")
        for i, (mult, matched) in enumerate(zip(spec.multipliers, hits, strict=True)):
            if site.name in matched:
                factor *= mult.value
                why.append(f"multipliers[{i}] x{mult.value:g}")
        out[site.name] = (factor, why)
    return out


@register_pass
class AQNNoisePass(Pass[NoiseSpec]):
    """Inserts `AQNNoise` on the weight of every site the policy's `noise` section selects."""

    name = "aqn_noise"
    tag = "aqn_noise"
    section = "noise"
    provides = ("aqn_noise",)

    def select(self, program: Program, spec: NoiseSpec) -> list[Action]:
        sites = select_sites(program, spec, "noise", kinds=NOISE_KINDS)
        factors = site_multipliers(program, spec, sites)
        config = NoiseConfig(Schedule.from_spec(spec.schedule), spec.resample, spec.apply_during, spec.seed)
        return [
            Action(site, "weight", "noise",
                   {"config": config, "multiplier": factors[site.name][0], "why": factors[site.name][1]})
            for site in sites
        ]

    def build(self, program: Program, action: Action) -> nn.Module:
        site = action.site
        weight = getattr(program.model.get_submodule(site.module_name), site.param or "weight")
        module = AQNNoise(action.site.name, action.params["multiplier"], action.params["config"], weight)
        return module.train(program.model.training)

    def describe(self, action: Action) -> str:
        s = action.params["config"].schedule
        end = "" if s.sigma_end is None else f"->{s.sigma_end:g}"
        why = action.params["why"]
        reason = why[0].rsplit(" x", 1)[0] if len(why) == 1 else ", ".join(why)
        return (f"{s.kind} {s.sigma_start:g}{end} K={s.stages}, sigma x{action.params['multiplier']:g}"
                + (f" ({reason})" if why else ""))
