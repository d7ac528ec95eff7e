"""AQN pass: QeRL's Adaptive Quantization Noise as a node on norm (or linear) weights.

The weight a site computes with becomes gamma + sigma_t * m_site * z. The parameter is never
written: the noise is an inserted module on the site's weight, so it cannot accumulate across
steps (the bug of in-place `weight.add_(noise)` implementations) and switching it off gives the
clean model back bit for bit. The schedule lives in `core/schedule.py`, the noise contract (step, switch, counters, export
form) in `core/noise.py`, the controller in `rl/noise.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qtransform.core import ops
from qtransform.core.noise import NoiseModule
from qtransform.core.program import Program
from qtransform.core.schedule import sigma_at
from qtransform.core.sharding import sharded
from qtransform.core.sites import LINEAR_KINDS, Site
from qtransform.errors import UserError
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas import NoiseSpec, Schedule
from qtransform.schemas.selectors import format_layers

NOISE_KINDS = ("norm", *LINEAR_KINDS)  # norms, linears, routers and fused experts


@dataclass(frozen=True)
class NoiseConfig:
    """What every AQN module of one transform shares."""

    schedule: Schedule  # the policy's noise.schedule
    resample: str  # "step": one draw per step; "forward": a fresh draw every forward
    apply_during: str  # "rollout" | "train" | "eval" | "both" (see qtransform.core.phase)
    seed: int


class AQNNoise(NoiseModule):
    """Adds sigma * z to the weight it receives; z and sigma are state, never parameters.

    z is a non-persistent buffer (it follows `.to(device)` but stays out of `state_dict()`),
    drawn in fp32 from the site's stream at (seed, site, step) and cast to the weight's dtype;
    with resample="forward" each forward draws its own z (replayed under gradient
    checkpointing). Under FSDP (`core.sharding.sharded`) the buffer is emptied and each forward
    draws the step's z again, so the module keeps no tensor the size of the unsharded weight
    (the same values: one generator seed per (seed, site, step)). `noise_override`, when set, is
    used as z instead (the ONNX exporter feeds a graph input). z is drawn on the CPU
    (`portable_draws`), so a model on a GPU noises its norms with the CPU's bits.
    """

    noise_pass = "aqn_noise"
    portable_draws = True

    def __init__(self, site: str, multiplier: float, config: NoiseConfig, weight: Tensor):
        super().__init__("add", AQNNoisePass.label(site, "weight"), seed=config.seed, stream_key=site,
                         apply_during=config.apply_during)
        self.site = site
        self.multiplier = multiplier
        self.config = config
        self.sigma = 0.0
        self.register_buffer("z", torch.zeros_like(weight), persistent=False)
        self.set_step(0)

    def extra_repr(self) -> str:
        return (f"label={self.label!r}, multiplier={self.multiplier:g}, step={self.step_index}, "
                f"sigma={self.sigma:.3g}, during={self.config.apply_during}")

    def scale(self) -> float:
        return self.sigma

    @torch.no_grad()
    def set_step(self, step: int, draws: int = 0) -> None:
        """Sigma for `step` from the schedule, and the step's draw of z."""
        self.sigma = sigma_at(step, self.config.schedule) * self.multiplier
        self.stream.set_step(step, draws)
        if sharded(self):
            self._release_z()
        elif self.z.numel():
            self.z.copy_(self._step_z(self.z.shape, self.z.device))

    def _step_z(self, shape: torch.Size, device: torch.device) -> Tensor:
        """The step's draw: fp32 normals from the (seed, site, step) generator, in z's dtype."""
        return self.sample(shape, self.z.new_empty(0, device=device), None).to(self.z.dtype)

    def _held_z(self, weight: Tensor) -> Tensor:
        """The step's z for `weight`: the buffer, or (sharded: no buffer is kept) a fresh draw."""
        if sharded(self) or self.z.shape != weight.shape:
            self._release_z()
            return self._step_z(weight.shape, weight.device)
        return self.z

    def _release_z(self) -> None:
        if self.z.numel():
            self.z = self.z.new_empty(0)  # stays a buffer: dtype and device follow .to()

    def draw(self, x: Tensor) -> Tensor:
        if self.config.resample == "forward":
            return super().draw(x)
        return self._held_z(x)

    def traced_draw(self, x: Tensor) -> Tensor:
        return self._held_z(x)

    def forward(self, weight: Tensor) -> Tensor:
        if sharded(self) and not ops.is_tracing(weight):
            self._release_z()  # the model was sharded after the transform: keep no full-size z
        return super().forward(weight)


def site_multipliers(program: Program, spec: NoiseSpec, sites: list[Site]) -> dict[str, tuple[float, list[str]]]:
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
    for i, mult in enumerate(spec.multipliers):
        where = f"noise.multipliers[{i}]"
        matched = {s.name for s in select_sites(program, mult, where, kinds=NOISE_KINDS)}
        if not matched & noised:
            raise UserError(f"{where}: matches only sites the noise section does not select "
                            f"(e.g. {sorted(matched)[0]})")
    out: dict[str, tuple[float, list[str]]] = {}
    for site in sites:
        terms = spec.multiplier_terms(site)
        out[site.name] = (spec.multiplier_for(site), [f"{where} x{value:g}" for where, value in terms])
    return out


@dataclass(frozen=True)
class AQNSite:
    """What `build` needs for one noised site: the shared config and the site's factor."""

    config: NoiseConfig
    multiplier: float  # m_site
    why: tuple[str, ...]  # where each factor of m_site comes from ("layer 14 x1.5", ...)
    weight_scale: float  # mean |w| of the site's clean weight (float64)
    relative: bool  # sigma_scale "mean_abs": sigma is a fraction of weight_scale

    @property
    def scale(self) -> float:
        """What sigma_t is multiplied by at this site: m_site, times mean |w| when relative."""
        return self.multiplier * (self.weight_scale if self.relative else 1.0)


def _weight(program: Program, site: Site) -> Tensor:
    weight = getattr(program.model.get_submodule(site.module_name), site.param or "weight")
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def mean_abs(weight: Tensor) -> float:
    """mean |w| in float64: the scale AQN's sigma is compared with (or a fraction of)."""
    with torch.no_grad():
        return float(weight.detach().double().abs().mean())


@register_pass
class AQNNoisePass(Pass[NoiseSpec, AQNSite]):
    """Inserts `AQNNoise` on the weight of every site the policy's `noise` section selects."""

    name = tag = AQNNoise.noise_pass
    section = "noise"
    provides = (name,)

    @classmethod
    def label(cls, site: str, point: str) -> str:
        return f"{site}/{point}_noise"

    def select(self, program: Program, spec: NoiseSpec) -> list[Action[AQNSite]]:
        sites = select_sites(program, spec, "noise", kinds=NOISE_KINDS)
        factors = site_multipliers(program, spec, sites)
        config = NoiseConfig(spec.schedule, spec.resample, spec.apply_during, spec.seed)
        relative = spec.sigma_scale == "mean_abs"
        actions = []
        for site in sites:
            scale = mean_abs(_weight(program, site))
            if relative and not scale > 0:
                raise UserError(f"noise.sigma_scale 'mean_abs': {site.name} has mean |w| {scale:g}, "
                                "so its noise would be 0; leave it out (ignore) or use 'absolute'")
            payload = AQNSite(config, factors[site.name][0], tuple(factors[site.name][1]), scale, relative)
            actions.append(Action(site, "weight", "noise", payload))
        return actions

    def build(self, program: Program, action: Action[AQNSite]) -> nn.Module:
        site = action.site
        weight = getattr(program.model.get_submodule(site.module_name), site.param or "weight")
        module = AQNNoise(action.site.name, action.payload.scale, action.payload.config, weight)
        return module.train(program.model.training)

    def describe(self, action: Action[AQNSite]) -> str:
        s = action.payload.config.schedule
        end = "" if s.sigma_end is None else f"->{s.sigma_end:g}"
        why = action.payload.why
        reason = why[0].rsplit(" x", 1)[0] if len(why) == 1 else ", ".join(why)
        during = action.payload.config.apply_during
        return (f"{s.kind} {s.sigma_start:g}{end} K={s.stages}, sigma x{action.payload.multiplier:g}"
                + (f" ({reason})" if why else "") + f", during {during}; " + _relative(action.payload))

    def notes(self, actions: list[Action[AQNSite]]) -> list[str]:
        """The extremes of sigma_start relative to each site's mean |w| (and absolute)."""
        if not actions:
            return []
        start = actions[0].payload.config.schedule.sigma_start
        rel = sorted(((start * a.payload.scale / a.payload.weight_scale, a) for a in actions
                      if a.payload.weight_scale > 0), key=lambda t: t[0])
        if not rel:
            return []
        (low, a_low), (high, a_high) = rel[0], rel[-1]
        median = rel[len(rel) // 2][0]
        return [f"AQN sigma_start relative to each site's mean |w|: min {low:.3g} at {a_low.site.name} "
                f"(mean |w| {a_low.payload.weight_scale:.3g}), median {median:.3g}, max {high:.3g} at "
                f"{a_high.site.name} (mean |w| {a_high.payload.weight_scale:.3g}); over {len(rel)} sites"]


def _relative(site: AQNSite) -> str:
    """sigma_start at a site, absolute and as a fraction of the site's mean |w|."""
    start = site.config.schedule.sigma_start
    absolute = start * site.scale
    if not site.weight_scale > 0:
        return f"sigma_start {absolute:.3g} (mean |w| 0)"
    return (f"sigma_start {absolute:.3g} = {absolute / site.weight_scale:.3g} x mean |w| "
            f"{site.weight_scale:.3g}")
