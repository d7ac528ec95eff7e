"""Hardware-error pass: Gaussian error on the input, weight or output of selected linears, and
(in whole-model graph mode) on attention matmul outputs.

relative_gaussian models a multiplier whose result is off by a fraction of itself, y*(1 + s*z);
absolute_gaussian an additive error y + s*z. z is fresh every forward, drawn in fp32 from the
counter-based Gaussian stream of (seed, site, step, forward) (formats/philox.py), so a run is
reproducible and the same on every device.
"""

from __future__ import annotations

from torch import nn

from qtransform.core.noise import NoiseModule
from qtransform.core.program import Program
from qtransform.core.sites import LINEAR_KINDS, Site
from qtransform.errors import UserError
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas import HWErrorSpec

OP_KIND = {"relative_gaussian": "relative", "absolute_gaussian": "add"}


class HWError(NoiseModule):
    """x*(1 + s*z) (relative) or x + s*z (absolute) with a fresh z each forward.

    z comes from the site's stream: draw k of step t is a function of (seed, site, t, k) only, so
    ranks agree and a checkpointed recompute replays the forward's own draw. `noise_override`,
    when set, is used as z instead of drawing (the ONNX exporter feeds a graph input). Under
    tracing without an override, z comes from `torch.randn_like`, so an exported graph still
    draws fresh noise each run.
    """

    noise_pass = "hw_error"
    counter_draws = True  # one normal per output element and forward: the fused Philox stream

    def __init__(self, error_type: str, scale: float, label: str, *, seed: int, apply_during: str):
        super().__init__(OP_KIND[error_type], label, seed=seed, stream_key=label, apply_during=apply_during)
        self.error_type = error_type
        self.error_scale = scale

    def extra_repr(self) -> str:
        return f"{self.error_type}, scale={self.error_scale:g}, label={self.label!r}, apply_during={self.apply_during}"

    def scale(self) -> float:
        return self.error_scale


def matmul_sites(program: Program, spec: HWErrorSpec) -> list[Site]:
    """Attention matmul sites for `include_matmuls`: every matmul site in `layers` that no
    `ignore` entry names. They exist only in the whole-model graph the model runs as."""
    if program.mode != "graph" or program.whole is None:
        raise UserError(
            "hw_error.include_matmuls: attention matmuls exist only in the whole-model graph; "
            "call transform(model, policy, example_inputs, mode='graph')"
        )
    selector = spec.selector()
    chosen = [s for s in program.sites.values()
              if s.kind == "matmul" and selector.in_layers(s) and not any(e.matches(s) for e in selector.ignore)]
    if not chosen:
        raise UserError(f"hw_error.include_matmuls: no attention matmul site (layers {spec.layers!r}, "
                        f"ignore {list(spec.ignore)}) in the captured graph")
    return chosen


@register_pass
class HWErrorPass(Pass[HWErrorSpec, HWErrorSpec]):
    """Inserts `HWError` at the policy's injection point of every selected site."""

    name = tag = section = HWError.noise_pass
    provides = (name,)

    def select(self, program: Program, spec: HWErrorSpec) -> list[Action[HWErrorSpec]]:
        kinds = LINEAR_KINDS + (("matmul",) if spec.include_matmuls else ())
        sites = select_sites(program, spec, "hw_error", kinds=kinds)
        actions = [Action(s, spec.injection_point if s.kind != "matmul" else "output", "hw_error", spec)
                   for s in sites]
        if spec.include_matmuls:
            chosen = {s.name for s in sites}
            actions += [Action(s, "output", "hw_error", spec)
                        for s in matmul_sites(program, spec) if s.name not in chosen]
        order = {name: i for i, name in enumerate(program.sites)}
        return sorted(actions, key=lambda a: order[a.site.name])

    def build(self, program: Program, action: Action[HWErrorSpec]) -> nn.Module:
        spec = action.payload
        label = self.label(action.site.name, action.point)
        module = HWError(spec.error_type, spec.error_scale, label, seed=spec.seed, apply_during=spec.apply_during)
        return module.train(program.model.training)

    def describe(self, action: Action[HWErrorSpec]) -> str:
        spec = action.payload
        return f"{spec.error_type} s={spec.error_scale:g} during {spec.apply_during}"
