"""The `noise` section: QeRL's Adaptive Quantization Noise (schedule, multipliers, targets).

The schedule is validated here once; its math (`sigma_at`, `stage_values`) is the pure functions of
`qtransform.core.schedule`, which read these same fields.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from qtransform.core.schedule import stage_values

from ..base import (
    Entries,
    Int,
    NonNegFloat,
    NonNegInt,
    Phase,
    PosFloat,
    PosInt,
    Selected,
    StrictModel,
)
from ..errors import Issue, problems_error
from ..selectors import SiteRef, format_layers
from ..words import PHASES, SHOWN, describe_selector
from . import Section, register_section


class Schedule(StrictModel):
    """How AQN's sigma changes over training (the math lives in `qtransform.core.schedule`).

    The run is given either as ``total_steps`` (split into ``num_stages`` equal intervals, default
    10) or per epoch as ``steps_per_epoch`` + ``stages_per_epoch`` (each epoch runs the whole
    schedule in ``stages_per_epoch`` intervals). In both, the first interval is noise-free and
    ``warmup_steps`` noise-free steps come before the intervals.
    """

    kind: Literal["exponential", "linear", "cosine", "constant"] = Field(
        "exponential", description="how sigma goes from sigma_start to sigma_end (QeRL: exponential)")
    sigma_start: PosFloat = Field(description="sigma of the first noisy interval")
    sigma_end: NonNegFloat | None = Field(None, description="required except for 'constant'")
    num_stages: PosInt | None = Field(None, description="K; null = 10 (total_steps mode only)")
    total_steps: PosInt | None = Field(
        None, description="the run's length in steps (or give steps_per_epoch + stages_per_epoch)")
    steps_per_epoch: PosInt | None = Field(
        None, description="per-epoch mode: steps in one epoch, each running the whole schedule")
    stages_per_epoch: PosInt | None = Field(None, description="per-epoch mode: K, intervals per epoch")
    epochs: PosInt | None = Field(
        None, description="per-epoch mode: after this many epochs sigma stays at its last value")
    warmup_steps: NonNegInt = Field(0, description="noise-free steps before the first interval")

    @property
    def per_epoch(self) -> bool:
        return self.steps_per_epoch is not None or self.stages_per_epoch is not None

    @property
    def stages(self) -> int:
        """K: the number of intervals one schedule is split into."""
        if self.per_epoch:
            return self.stages_per_epoch or 0
        return self.num_stages if self.num_stages is not None else 10

    @model_validator(mode="after")
    def _consistent(self) -> Schedule:
        issues = self._mode_issues()
        if not issues:  # the checks below need a well-defined K and run length
            issues = self._length_issues() + self._sigma_issues()
        if issues:
            raise problems_error(issues)
        return self

    def _mode_issues(self) -> list[Issue]:
        """Exactly one way to give the run length: total_steps, or the per-epoch pair."""
        if self.total_steps is not None and self.per_epoch:
            return [Issue(("total_steps",), f"give total_steps or {_PAIR}, not both")]
        if not self.per_epoch:
            if self.total_steps is None:
                return [Issue(("total_steps",), f"missing: give total_steps, or {_PAIR}")]
            if self.epochs is not None:
                return [Issue(("epochs",), f"only used with {_PAIR}", self.epochs)]
            return []
        issues = [
            Issue((name,), f"missing: {_PAIR} go together")
            for name in ("steps_per_epoch", "stages_per_epoch")
            if getattr(self, name) is None
        ]
        if self.num_stages is not None:
            issues.append(Issue(("num_stages",), "not used with stages_per_epoch", self.num_stages))
        return issues

    def _length_issues(self) -> list[Issue]:
        """Every stage needs at least one step after the warmup."""
        if self.per_epoch:
            steps, where = self.steps_per_epoch, "steps_per_epoch"
            span = steps * (self.epochs or 1)
        else:
            span, where = self.total_steps, "total_steps"
            steps = span - self.warmup_steps
        if self.warmup_steps >= span:
            return [
                Issue(
                    ("warmup_steps",), f"leaves no step to train ({span} in all)", self.warmup_steps
                )
            ]
        if steps < self.stages:
            return [
                Issue((where,), f"too few steps for {self.stages} stages", getattr(self, where))
            ]
        return []

    def _sigma_issues(self) -> list[Issue]:
        field = "stages_per_epoch" if self.per_epoch else "num_stages"
        if self.kind == "constant":
            if self.sigma_end is not None:
                return [Issue(("sigma_end",), "not used by a constant schedule", self.sigma_end)]
            return [] if self.stages >= 2 else [Issue((field,), _TWO_STAGES, self.stages)]
        if self.sigma_end is None:
            return [Issue(("sigma_end",), f"missing: required by a {self.kind} schedule")]
        issues = []
        if self.sigma_end > self.sigma_start:
            issues.append(
                Issue(("sigma_end",), "must be <= sigma_start (sigma decays)", self.sigma_end)
            )
        if self.kind != "exponential":
            return issues + (
                [] if self.stages >= 2 else [Issue((field,), _TWO_STAGES, self.stages)]
            )
        if self.sigma_end == 0:
            issues.append(Issue(("sigma_end",), _ZERO_END, self.sigma_end))
        if self.stages < 3:
            issues.append(Issue((field,), _THREE_STAGES, self.stages))
        return issues


_PAIR = "steps_per_epoch and stages_per_epoch"
_TWO_STAGES = "needs at least 2 stages (the first one is noise-free)"
_THREE_STAGES = (
    "the exponential (QeRL) schedule needs at least 3 stages: the first is noise-free and "
    "sigma_i = sigma_start * (sigma_end/sigma_start)^(i/(K-2)) divides by K-2"
)
_ZERO_END = (
    "must be > 0 for an exponential schedule: the ratio sigma_end/sigma_start = 0 makes every "
    "stage after the first noise-free (0^x = 0), so AQN silently stops; use e.g. sigma_start/100"
)


class Multiplier(Selected):
    """Scale sigma at the selected sites."""

    targets: Entries = Field(min_length=1, description="the sites whose sigma is scaled (required)")
    value: PosFloat = Field(description="the factor; the factors of all matching entries multiply")


class NoiseSpec(Selected):
    """QeRL's Adaptive Quantization Noise: Gaussian noise on norm weights, on a schedule."""

    targets: Entries = Field(default_factory=lambda: ["RMSNorm", "LayerNorm"], min_length=1,
                             description="the sites whose weights get noise (default: the norms)")
    schedule: Schedule = Field(description="sigma over training")
    layer_multipliers: dict[NonNegInt, PosFloat] = Field(
        default_factory=dict,
        description='sigma multiplier per layer index, e.g. {"14": 1.5}',
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}},
    )
    multipliers: list[Multiplier] = Field(default_factory=list,
                                          description="sigma factors for selected sites")
    resample: Literal["step", "forward"] = Field(
        "step", description="a new draw every step (all forwards of a step alike) or every forward")
    apply_during: Phase = Field("rollout", description="rollout (QeRL: generate() and rollout weights only), train, eval or both")
    seed: Int = Field(0, description="seed of the draws (with the site and step: reproducible)")
    sigma_scale: Literal["absolute", "mean_abs"] = Field(
        "absolute", description="absolute: sigma is added as is, whatever a weight's scale (QeRL); "
        "mean_abs: sigma is a fraction of each site's mean |w| (its clean weight at transform "
        "time), so sigma 0.04 is 4 % noise on every norm")

    @field_validator("layer_multipliers", mode="before")
    @classmethod
    def _layer_keys(cls, value: object) -> Any:
        """JSON object keys are strings: accept "14" and 14 alike, as integers."""
        if not isinstance(value, dict):
            return value
        out: dict[Any, Any] = {}
        issues = []
        for key, mult in value.items():
            text = (
                str(key).strip()
                if isinstance(key, (str, int)) and not isinstance(key, bool)
                else ""
            )
            if not (text.isascii() and text.isdigit()):
                issues.append(
                    Issue((key,), "key must be a layer index (a non-negative integer)", key)
                )
            elif int(text) in out:
                issues.append(Issue((key,), f"layer {int(text)} is given twice", key))
            else:
                out[int(text)] = mult
        if issues:
            raise problems_error(issues)
        return out

    def multiplier_terms(self, site: SiteRef) -> list[tuple[str, float]]:
        """The factors that scale sigma at `site`, with where each comes from: its layer's
        `layer_multipliers` entry and every matching `multipliers` entry (the rule, in one place)."""
        terms = []
        if site.layer is not None and site.layer in self.layer_multipliers:
            terms.append((f"layer {site.layer}", self.layer_multipliers[site.layer]))
        for i, mult in enumerate(self.multipliers):
            if mult.selector().matches(site):
                terms.append((f"multipliers[{i}]", mult.value))
        return terms

    def multiplier_for(self, site: SiteRef) -> float:
        """m_site: the product of `multiplier_terms` (1 when none applies)."""
        return math.prod(value for _, value in self.multiplier_terms(site))


def describe_schedule(s: Schedule) -> str:
    sigmas = stage_values(s)
    shown = [f"{v:.3g}" for v in sigmas[:SHOWN]]
    if len(sigmas) > SHOWN:
        shown += ["...", f"{sigmas[-1]:.3g}"]
    if s.per_epoch:
        length = f"each epoch of {s.steps_per_epoch} steps runs the schedule in {s.stages} stages"
        if s.epochs is not None:
            length += f" ({s.epochs} epochs)"
    else:
        per = (s.total_steps - s.warmup_steps) // s.stages
        length = f"{s.total_steps} steps in {s.stages} stages of ~{per} steps"
    warm = f" after {s.warmup_steps} noise-free warmup steps" if s.warmup_steps else ""
    span = (
        f"sigma {s.sigma_start:.3g}"
        if s.kind == "constant"
        else (f"sigma {s.sigma_start:.3g} -> {s.sigma_end:.3g}")
    )
    return (
        f"{s.kind} schedule, {span}: {length}{warm}; stage 0 is noise-free, "
        f"then sigma = {', '.join(shown)}."
    )


def describe_noise(n: NoiseSpec) -> list[str]:
    lines = [
        f"AQN noise: Gaussian noise on the weights of {describe_selector(n).rstrip(',')}, resampled every "
        f"{n.resample}, {PHASES[n.apply_during]}, seed {n.seed}.",
        "  Schedule: " + describe_schedule(n.schedule),
        ("  Sigma is a fraction of each site's mean |w| (sigma_scale mean_abs)."
         if n.sigma_scale == "mean_abs" else
         "  Sigma is absolute (added as is, whatever a weight's scale): `qtransform plan` shows it "
         "relative to each site's mean |w|."),
    ]
    by_value: dict[float, list[int]] = {}
    for layer, value in n.layer_multipliers.items():
        by_value.setdefault(value, []).append(layer)
    mults = [
        f"x{v:g} in layer{'s' if len(ls) > 1 else ''} {format_layers(ls)}"
        for v, ls in by_value.items()
    ]
    mults += [f"x{m.value:g} for {describe_selector(m).rstrip(',')}" for m in n.multipliers]
    if mults:
        lines.append("  Sigma multipliers (combined by product): " + "; ".join(mults) + ".")
    return lines


def summary(n: NoiseSpec) -> str:
    s = n.schedule
    return f"noise ({s.kind}, sigma_start {s.sigma_start:g}, {s.stages} stages)"


register_section(Section("noise", NoiseSpec | None, None, describe_noise, summary, order=2,
                         description="QeRL's adaptive quantization noise (AQN) on a schedule",
                         example={"schedule": {"kind": "constant", "sigma_start": 0.01, "total_steps": 4,
                                               "num_stages": 2}, "apply_during": "both"}))
