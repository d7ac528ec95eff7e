"""The `calibration` section: how the calibration run that sets static scales runs the model.

Static scales (`scale_source: "static"` in a quantize rule) are calibrated on the full-precision
model, as llm-compressor 0.14 and ModelOpt calibrate; the stacks differ in the attention kernel
of that run, which changes the observed activations in their last bits: llm-compressor forces
eager attention (`calibration_forward_context`), ModelOpt runs the model as it is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..base import StrictModel
from . import Section, register_section


class CalibrationSpec(StrictModel):
    """Options of the calibration run (no effect without static scales)."""

    attention: Literal["model", "eager"] = Field(
        "model", description="the attention of the calibration run: model = the model's own "
        "implementation; eager = transformers' eager attention, as llm-compressor 0.14 calibrates")


def describe(spec: CalibrationSpec) -> list[str]:
    how = ("with transformers' eager attention (as llm-compressor calibrates)"
           if spec.attention == "eager" else "with the model's own attention")
    return [f"Calibration: static scales are calibrated on the full-precision model {how}."]


def summary(spec: CalibrationSpec) -> str:
    return f"calibration ({spec.attention} attention)"


register_section(Section("calibration", CalibrationSpec | None, None, describe, summary, order=6,
                         description="how the calibration run of static scales runs the model",
                         example={"attention": "eager"}))
