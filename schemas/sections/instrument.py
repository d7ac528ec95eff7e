"""The `instrument` section: taps that measure quantization error (SRDD scans)."""

from __future__ import annotations

from pydantic import Field, StrictBool, field_validator

from ..base import (
    METRICS,
    TENSORS,
    Float,
    Fraction,
    Metric,
    NonNegFloat,
    Selected,
    StrictModel,
    Tensor,
    unique,
)
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

    points: list[Tensor] = Field(default_factory=lambda: list(TENSORS), min_length=1)
    metrics: list[Metric] = Field(default_factory=lambda: list(METRICS), min_length=1)
    shadow: StrictBool = Field(True, description="measure on a shadow copy; outputs stay unchanged")
    thresholds: Thresholds = Field(default_factory=Thresholds)

    @field_validator("points", "metrics")
    @classmethod
    def _no_repeats(cls, values: list[str]) -> list[str]:
        return unique(values)


def describe(spec: InstrumentSpec) -> list[str]:
    t = spec.thresholds
    where = "on a shadow copy (outputs unchanged)" if spec.shadow else "on the live forward values"
    return [
        f"Instrumentation: taps the {join([TENSOR_WORDS[p] for p in spec.points])} of "
        f"{describe_selector(spec)} and records {', '.join(spec.metrics)} {where}.",
        f"  A site is flagged when SQNR < {t.sqnr_db:g} dB, deadzone > {t.deadzone:.3g}, "
        f"saturation > {t.saturation:.3g} or rel_rmse > {t.relative_error:.3g}.",
    ]


def summary(spec: InstrumentSpec) -> str:
    return f"instrument ({len(spec.metrics)} metrics)"


register_section(Section("instrument", InstrumentSpec | None, None, describe, summary, order=1))
