"""Activation-noise pass: dropout-style or multiplicative Gaussian noise on a site's input or output.

What users train for robustness with beyond weight noise: inverted dropout on activations
(y = x*m/(1-p), m ~ Bernoulli(1-p)) or a relative Gaussian error (y = x*(1 + sigma*z)). Both are
fresh every forward from the site's seeded stream, so runs reproduce and ranks agree.

The module is a `NoiseModule` and the formulas are noise kinds: dropout is a new kind, registered
here with its eager form, gradient and ONNX form; the Gaussian reuses the `relative` kind. That is
all a noise pass needs: the controller steps and switches it off, and the ONNX export feeds its
draw as a `noise:<site>/<point>` input, without either naming this pass.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qtransform.core.noise import NoiseModule
from qtransform.core.noise_kinds import NoiseKind, OnnxBuilder, register_noise_kind
from qtransform.core.program import Program
from qtransform.core.sites import LINEAR_KINDS
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas.sections.activation_noise import PARAMETER, ActivationNoiseSpec

KIND = {"dropout": "dropout", "gaussian": "relative"}  # distribution -> registered noise kind


# -- the dropout kind: z ~ U[0, 1), an element is dropped where z < p ---------------------------
# Written as (x * 1/(1-p)) * m with m in {0, 1}, as torch's own dropout multiplies by its mask: a
# dropped element is x*0 (sign kept, NaN stays NaN). A select (`where`) would say the same in
# PyTorch, but onnxruntime's Where drops the sign of -0, so the ONNX form could not equal it.
def _fp32(value: float) -> float:
    """`value` rounded to fp32, so eager, op and ONNX constants are the same number."""
    return float(torch.tensor(value, dtype=torch.float32))


def _keep_scale(p: float) -> float:
    return _fp32(1.0 / (1.0 - p))


def _dropout(x: Tensor, z: Tensor, p: float) -> Tensor:
    return (x * _keep_scale(p)) * (z >= _fp32(p)).to(x.dtype)


def _dropout_grad(grad: Tensor, z: Tensor, p: float) -> Tensor:
    return (grad * (z >= _fp32(p)).to(grad.dtype)) * _keep_scale(p)


def _dropout_onnx(b: OnnxBuilder, p: float) -> str:
    keep = b.as_float(b.op("GreaterOrEqual", b.as_float("Z"), b.const(_fp32(p))))
    return b.op("Mul", b.rounded(b.op("Mul", b.as_float("X"), b.const(_keep_scale(p)))), keep)


register_noise_kind(NoiseKind("dropout", "x*m/(1-p), m = (z >= p), z ~ U[0, 1)", _dropout, _dropout_grad,
                              _dropout_onnx, draw="uniform", neutral=None))


class ActivationNoise(NoiseModule):
    """Dropout or relative Gaussian noise on the activation it receives, fresh each forward."""

    noise_pass = "activation_noise"
    counter_draws = True  # the Gaussian's normals: the fused Philox stream, as hardware error's

    def __init__(self, spec: ActivationNoiseSpec, label: str):
        super().__init__(KIND[spec.distribution], label, seed=spec.seed, stream_key=label,
                         apply_during=spec.apply_during)
        self.distribution = spec.distribution
        self.amount = spec.scale

    def extra_repr(self) -> str:
        return f"{self.distribution}, scale={self.amount:g}, label={self.label!r}, apply_during={self.apply_during}"

    def scale(self) -> float:
        return self.amount


@register_pass
class ActivationNoisePass(Pass[ActivationNoiseSpec, ActivationNoiseSpec]):
    """Inserts `ActivationNoise` at the section's point of every selected site."""

    name = tag = section = ActivationNoise.noise_pass
    provides = (name,)

    def select(self, program: Program, spec: ActivationNoiseSpec) -> list[Action[ActivationNoiseSpec]]:
        return [Action(site, spec.point, "activation_noise", spec)
                for site in select_sites(program, spec, "activation_noise", kinds=LINEAR_KINDS)]

    def build(self, program: Program, action: Action[ActivationNoiseSpec]) -> nn.Module:
        module = ActivationNoise(action.payload, self.label(action.site.name, action.point))
        return module.train(program.model.training)

    def describe(self, action: Action[ActivationNoiseSpec]) -> str:
        spec = action.payload
        return f"{spec.distribution} {PARAMETER[spec.distribution]}={spec.scale:g} during {spec.apply_during}"
