"""The `instrument` section: taps that measure quantization error (SRDD scans)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, StrictBool, field_validator, model_validator

from ..base import (
    TENSORS,
    Float,
    Fraction,
    NonNegFloat,
    QuantTensor,
    Selected,
    StrictModel,
    unique,
)
from ..errors import Issue, problems_error
from ..words import TENSOR_WORDS, describe_selector, join
from . import Section, register_section


class Thresholds(StrictModel):
    """When a scanned site is flagged as a problem."""

    sqnr_db: Float = Field(20.0, description="problem if SQNR (dB) is below")
    deadzone: Fraction = Field(0.05, description="problem if the deadzone ratio is above")
    saturation: Fraction = Field(0.01, description="problem if the saturation ratio is above")
    relative_error: NonNegFloat = Field(0.10, description="problem if rel_rmse is above")


class InstrumentSpec(Selected):
    """Measure quantization error (SRDD scans) at the selected sites."""

    points: list[QuantTensor] = Field(
        default_factory=lambda: list(TENSORS), min_length=1,
        description="the points tapped: weight, input and/or output of Linear sites; query, key, "
                    "value and/or probs of attention sites (without any, an attention site is "
                    "tapped where it is quantized)")
    shadow: StrictBool = Field(True, description="measure on a shadow copy; outputs stay unchanged")
    saturation: StrictBool = Field(
        True, description="compute the format's clipped-at-max mask (the saturation metric)")
    block_exponents: StrictBool = Field(
        True, description="histogram the shared block exponents of quantized weights (MX)")
    thresholds: Thresholds = Field(default_factory=Thresholds,
                                   description="when a scanned site is flagged as a problem")

    @model_validator(mode="before")
    @classmethod
    def _metrics_removed(cls, data: object) -> Any:
        """`metrics` listed 11 names but selected nothing: the error statistics are one pass,
        always all computed. Its two real choices are the booleans above."""
        if isinstance(data, dict) and "metrics" in data:
            raise problems_error([Issue(
                ("metrics",), "removed: every error metric is always computed (one pass); delete "
                "this field, and set saturation / block_exponents to false to skip those two",
                data["metrics"])])
        return data

    @field_validator("points")
    @classmethod
    def _no_repeats(cls, values: list[str]) -> list[str]:
        return unique(values)


def describe(spec: InstrumentSpec) -> list[str]:
    t = spec.thresholds
    where = "on a shadow copy (outputs unchanged)" if spec.shadow else "on the live forward values"
    return [
        f"Instrumentation: taps the {join([TENSOR_WORDS[p] for p in spec.points])} of "
        f"{describe_selector(spec)} and records {_recorded(spec)} {where}.",
        f"  A site is flagged when SQNR < {t.sqnr_db:g} dB, deadzone > {t.deadzone:.3g}, "
        f"saturation > {t.saturation:.3g} or rel_rmse > {t.relative_error:.3g}.",
    ]


def _recorded(spec: InstrumentSpec) -> str:
    extra = [w for w, on in (("saturation", spec.saturation), ("block exponents", spec.block_exponents)) if on]
    return join(["the error metrics", *extra])


def summary(spec: InstrumentSpec) -> str:
    return f"instrument ({join(spec.points)})"


register_section(Section("instrument", InstrumentSpec | None, None, describe, summary, order=1,
                         description="taps that measure quantization error (scans)",
                         example={"targets": ["*.down_proj"], "points": ["input", "output"]}))
