"""Hardware-error pass: Gaussian error on the input, weight or output of selected linears, and
(in whole-model graph mode) on attention matmul outputs.

relative_gaussian models a multiplier whose result is off by a fraction of itself, y*(1 + s*z);
absolute_gaussian an additive error y + s*z. z is fresh every forward, drawn in fp32 from a
per-module generator seeded by (seed, site), so a run is reproducible.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qtransform.core import ops
from qtransform.core.phase import active
from qtransform.core.program import Program
from qtransform.core.sites import LINEAR_KINDS, Site
from qtransform.core.streams import DrawStream
from qtransform.errors import UserError
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas import HWErrorSpec

OP_KIND = {"relative_gaussian": "relative", "absolute_gaussian": "add"}


class HWError(nn.Module):
    """x*(1 + s*z) (relative) or x + s*z (absolute) with a fresh z each forward.

    z comes from the site's stream: draw k of step t is a function of (seed, site, t, k) only, so
    ranks agree and a checkpointed recompute replays the forward's own draw. `noise_override`,
    when set, is used as z instead of drawing (the ONNX exporter feeds a graph input). Under
    tracing without an override, z comes from `torch.randn_like`, so an exported graph still
    draws fresh noise each run.
    """

    def __init__(self, error_type: str, scale: float, label: str, *, seed: int, apply_during: str):
        super().__init__()
        self.error_type = error_type
        self.kind = OP_KIND[error_type]
        self.scale = scale
        self.label = label
        self.apply_during = apply_during
        self.enabled = True
        self.noise_override: Tensor | None = None
        self.stream = DrawStream(seed, label)

    def extra_repr(self) -> str:
        return f"{self.error_type}, scale={self.scale:g}, label={self.label!r}, apply_during={self.apply_during}"

    def set_step(self, step: int, draws: int = 0) -> None:
        self.stream.set_step(step, draws)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale if self.enabled and active(self.apply_during, self.training) else 0.0
        z = self.noise_override
        if ops.is_tracing(x):
            z = torch.randn_like(x, dtype=torch.float32) if z is None else z
            return torch.ops.qtransform.noise(x, z, scale, self.kind, self.label)
        if scale == 0.0:
            return x
        z = self.stream.normal(x.shape, x, self.stream.next_index(self.training)) if z is None else z.to(x.dtype)
        return x * (1 + scale * z) if self.kind == "relative" else x + scale * z


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
class HWErrorPass(Pass[HWErrorSpec]):
    """Inserts `HWError` at the policy's injection point of every selected site."""

    name = "hw_error"
    tag = "hw_error"
    section = "hw_error"
    provides = ("hw_error",)

    def select(self, program: Program, spec: HWErrorSpec) -> list[Action]:
        kinds = LINEAR_KINDS + (("matmul",) if spec.include_matmuls else ())
        sites = select_sites(program, spec, "hw_error", kinds=kinds)
        actions = [Action(s, spec.injection_point if s.kind != "matmul" else "output", "hw_error", {"spec": spec})
                   for s in sites]
        if spec.include_matmuls:
            chosen = {s.name for s in sites}
            actions += [Action(s, "output", "hw_error", {"spec": spec})
                        for s in matmul_sites(program, spec) if s.name not in chosen]
        order = {name: i for i, name in enumerate(program.sites)}
        return sorted(actions, key=lambda a: order[a.site.name])

    def build(self, program: Program, action: Action) -> nn.Module:
        spec = action.params["spec"]
        label = f"{action.site.name}/{action.point}_hw_error"
        module = HWError(spec.error_type, spec.error_scale, label, seed=spec.seed, apply_during=spec.apply_during)
        return module.train(program.model.training)

    def describe(self, action: Action) -> str:
        spec = action.params["spec"]
        return f"{spec.error_type} s={spec.error_scale:g} during {spec.apply_during}"
