"""The `activation_noise` section: dropout-style or multiplicative Gaussian noise on activations.

Robustness training beyond weights: the input or output activations of the selected sites are
dropped (y = x*m/(1-p), m ~ Bernoulli(1-p), inverted dropout) or scaled by a relative Gaussian
error (y = x*(1 + sigma*z), z ~ N(0, 1)), drawn fresh every forward from a seeded stream.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AllowInfNan, Field, Strict, model_validator

from ..base import Int, Phase, PosFloat, Selected
from ..errors import Issue, problems_error
from ..words import PHASES, TENSOR_WORDS, describe_selector
from . import Section, register_section

DropRate = Annotated[float, Strict(), AllowInfNan(False), Field(ge=0, lt=1)]
PARAMETER = {"dropout": "p", "gaussian": "sigma"}  # the one scale field each distribution reads


class ActivationNoiseSpec(Selected):
    """Noise on the input or output activations of the selected sites, fresh every forward."""

    distribution: Literal["dropout", "gaussian"] = Field(
        "dropout",
        description="dropout: y = x*m/(1-p) with m ~ Bernoulli(1-p); gaussian: y = x*(1 + sigma*z), z ~ N(0, 1)",
    )
    p: DropRate | None = Field(None, description="drop probability, 0 <= p < 1 (dropout only)")
    sigma: PosFloat | None = Field(None, description="standard deviation of the relative error (gaussian only)")
    point: Literal["input", "output"] = Field("output", description="which activation of each site is noised")
    apply_during: Phase = Field("train", description="train (as dropout), eval, both or rollout")
    seed: Int = Field(0, description="seed of the draws (each site and step has its own stream)")

    @model_validator(mode="after")
    def _one_scale(self) -> ActivationNoiseSpec:
        wanted = PARAMETER[self.distribution]
        issues = [Issue((name,), f"not used by distribution {self.distribution!r} (it reads {wanted})",
                        getattr(self, name))
                  for name in PARAMETER.values() if name != wanted and getattr(self, name) is not None]
        if getattr(self, wanted) is None:
            issues.insert(0, Issue((wanted,), f"missing: required by distribution {self.distribution!r}"))
        if issues:
            raise problems_error(issues)
        return self

    @property
    def scale(self) -> float:
        """p for dropout, sigma for gaussian: the scale of the noise kind the pass inserts."""
        return getattr(self, PARAMETER[self.distribution])


def describe(spec: ActivationNoiseSpec) -> list[str]:
    formula = (f"dropout y = x*m/(1-p), m ~ Bernoulli(1-p), p = {spec.scale:g}" if spec.distribution == "dropout"
               else f"multiplicative Gaussian y = x*(1 + sigma*z), z ~ N(0, 1), sigma = {spec.scale:g}")
    return [f"Activation noise: {formula}, on the {TENSOR_WORDS[spec.point]} of "
            f"{describe_selector(spec).rstrip(',')}, fresh every forward, {PHASES[spec.apply_during]}, "
            f"seed {spec.seed}."]


def summary(spec: ActivationNoiseSpec) -> str:
    return f"activation_noise ({spec.distribution} {PARAMETER[spec.distribution]}={spec.scale:g} on {spec.point})"


register_section(Section("activation_noise", ActivationNoiseSpec | None, None, describe, summary, order=4,
                         description="dropout or multiplicative Gaussian noise on the input or output "
                                     "activations of the selected sites",
                         example={"targets": ["*.mlp.*"], "p": 0.1}))
