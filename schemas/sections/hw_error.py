"""The `hw_error` section: simulated hardware (matmul) error on selected sites."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool

from ..base import Int, Phase, PosFloat, Selected, Tensor
from ..words import PHASES, TENSOR_WORDS, describe_selector
from . import Section, register_section


class HWErrorSpec(Selected):
    """Simulated hardware (matmul) error: relative y*(1+s*z) or absolute y+s*z Gaussian."""

    error_type: Literal["relative_gaussian", "absolute_gaussian"] = Field(
        "relative_gaussian", description="relative_gaussian: y*(1 + s*z); absolute_gaussian: y + s*z")
    error_scale: PosFloat = Field(description="s, the standard deviation of the error (> 0)")
    injection_point: Tensor = Field("output", description="the point the error is added to")
    apply_during: Phase = Field("both", description="when the error applies: train, eval, both or rollout")
    seed: Int = Field(0, description="seed of the draws (with the site and step: reproducible)")
    include_matmuls: StrictBool = Field(
        False, description="also attention matmuls (whole-graph mode)"
    )


def describe(h: HWErrorSpec) -> list[str]:
    formula = "y*(1 + s*z)" if h.error_type == "relative_gaussian" else "y + s*z"
    kind = h.error_type.replace("_", " ")
    matmuls = (
        "attention matmuls included" if h.include_matmuls else "attention matmuls not included"
    )
    return [(
        f"Hardware error: {kind} {formula} with s = {h.error_scale:g}, z ~ N(0, 1), on the "
        f"{TENSOR_WORDS[h.injection_point]} of {describe_selector(h).rstrip(',')}, {PHASES[h.apply_during]}, "
        f"seed {h.seed} ({matmuls})."
    )]


def summary(h: HWErrorSpec) -> str:
    return f"hw_error ({h.error_type} {h.error_scale:g})"


register_section(Section("hw_error", HWErrorSpec | None, None, describe, summary, order=3,
                         description="simulated hardware (matmul) error on the selected sites",
                         example={"targets": ["*.o_proj"], "error_scale": 0.05}))
