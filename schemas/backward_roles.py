"""The backward roles of a quantize rule (`backward: "quantized"`): how each operand of the
backward GEMMs is fake-quantized, and the Hadamard rotation of the wgrad operands
(docs/training.md). Their numerics live in `qtransform.core.backward`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr, field_validator, model_validator

from qtransform.core.backward import Hadamard
from qtransform.formats import registry
from qtransform.formats.eden import BLOCK, BLOCK_MAX, SCALE_MAX, Eden
from qtransform.formats.hadamard import is_power_of_two
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import GRANULARITIES

from .base import Int, PosFloat, PosInt, StrictModel
from .errors import Issue, problems_error
from .format_fields import (
    FOUR_OVER_SIX_HELP,
    FOUR_OVER_SIX_ORDER_HELP,
    GLOBAL_BOUND_HELP,
    GLOBAL_BOUNDS,
    OPTION_DEFAULTS,
    all_option_values,
    known_format,
    lowered,
)

ROLE_ROUNDING = {"nearest": "rne", "stochastic": "stochastic"}  # a role's rounding -> the format's


class EdenRole(StrictModel):
    """Quartet II's EDEN quantizer for one operand (qtransform.formats.eden): NVFP4 elements
    rounded to nearest (ties away from zero), each group's scales multiplied by EDEN's correction
    and rounded to E4M3 stochastically."""

    group: PosInt = Field(128, description="elements one correction factor covers, along the "
                          "reduction axis: the block of the operand's Hadamard rotation (a multiple of 16)")
    block_max: PosFloat = Field(BLOCK_MAX, description="the value a block's amax maps to "
                                "(Quartet II: 6 / ((17/16) * 0.93))")
    scale_max: PosFloat = Field(SCALE_MAX, description="the E4M3 value the operand's amax maps "
                                "to (Quartet II: 255.99, room for the correction below 448)")

    @field_validator("group")
    @classmethod
    def _whole_blocks(cls, value: int) -> int:
        if value % BLOCK:
            raise problems_error([Issue((), f"must be a multiple of NVFP4's block of {BLOCK}", value,
                                        hint=" (e.g. 128)")])
        return value


class RoleQuant(StrictModel):
    """How one operand of the backward GEMMs is fake-quantized (along its GEMM's reduction axis)."""

    format: StrictStr = Field(json_schema_extra={"enum": list(registry.names())},
                              description="a registered format, e.g. nvfp4, mxfp4, mxfp8_e4m3")
    granularity: Literal[GRANULARITIES] | None = Field(  # type: ignore[valid-type]
        None, description="what one scale covers (block, tensor, ...; tile for the weight role "
        "only); null = block of block_size, or tile when block_shape is given")
    block_size: PosInt | None = Field(None, description="elements per block; null = format default")
    block_shape: tuple[PosInt, PosInt] | None = Field(
        None, description="weight role only: 2D tiles (16x16 for NVFP4), one copy valid in both "
        "orientations")
    scale_rule: StrictStr = Field(
        OPTION_DEFAULTS["scale_rule"], json_schema_extra={"enum": all_option_values("scale_rule")},
        description="how an MX block's shared exponent is chosen (MX formats only)")
    scale_dtype: StrictStr = Field(
        OPTION_DEFAULTS["scale_dtype"], json_schema_extra={"enum": all_option_values("scale_dtype")},
        description="the float scales are computed in (formats that take it)")
    four_over_six: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("four_over_six"), None]},
        description=FOUR_OVER_SIX_HELP)
    four_over_six_order: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("four_over_six_order"), None]},
        description=FOUR_OVER_SIX_ORDER_HELP)
    global_bound: Literal[GLOBAL_BOUNDS] | None = Field(  # type: ignore[valid-type]
        None, description=GLOBAL_BOUND_HELP)
    rounding: Literal["nearest", "stochastic"] = Field(
        "nearest", description="nearest = half to even; stochastic = the Philox stream of seed "
        "(unbiased), new draws for every backward call")
    seed: Int | None = Field(None, description="seed of stochastic rounding's stream (default 0)")
    source: Literal["high_precision", "forward"] = Field(
        "high_precision", description="weight and input roles: what is quantized: high_precision = "
        "the operand before the forward's fake-quant; forward = the forward's quantized copy, "
        "requantized along this GEMM's reduction axis (FP-Quant's mxfp8/mxfp4 backwards)")
    eden: EdenRole | None = Field(
        None, description="format nvfp4 only: Quartet II's EDEN quantizer (an unbiased estimate "
        "after a random Hadamard; its scale draws use seed); null = the format's own quantizer")

    _format_lower = field_validator("format", mode="before")(lowered)
    _format_known = field_validator("format")(known_format)

    @model_validator(mode="after")
    def _options_fit_format(self) -> RoleQuant:
        spec = registry.get(self.format)
        issues = []
        for option in ("scale_rule", "scale_dtype", "four_over_six", "global_bound",
                       "four_over_six_order"):
            value = getattr(self, option)
            if value is None:
                continue
            value = str(value)  # global_bound: an int in policies
            allowed = spec.options.get(option) or OPTION_DEFAULTS.get(option, ())
            allowed = (allowed,) if isinstance(allowed, str) else allowed
            if value not in allowed:
                issues.append(Issue((option,), f"not supported by {spec.name}", value, allowed,
                                    registry.suggest(value, allowed)))
        if self.rounding == "stochastic" and "stochastic" not in spec.options.get("rounding", ()):
            issues.append(Issue(("rounding",), f"{spec.name} has no stochastic rounding", self.rounding))
        if self.seed is not None and self.rounding != "stochastic" and self.eden is None:
            issues.append(Issue(("seed",), "only used with rounding 'stochastic' or eden", self.seed))
        if self.eden is not None:
            issues += self._eden_issues()
        if not issues:
            try:
                self.config()
            except ValueError as exc:
                issues.append(Issue((), str(exc)))
        if issues:
            raise problems_error(issues)
        return self

    def _eden_issues(self) -> list[Issue]:
        """EDEN is its own NVFP4 quantizer: it takes none of the format's options."""
        if self.format != "nvfp4":
            return [Issue(("eden",), f"is an NVFP4 quantizer; the role's format is {self.format}",
                          hint=' (set "format": "nvfp4")')]
        issues = []
        fixed = {"granularity": None, "block_size": None, "block_shape": None, "four_over_six": None,
                 "global_bound": None, "rounding": "nearest",
                 "scale_dtype": OPTION_DEFAULTS["scale_dtype"], "scale_rule": OPTION_DEFAULTS["scale_rule"]}
        for key, default in fixed.items():
            if getattr(self, key) != default:
                issues.append(Issue((key,), "is fixed by eden (1x16 blocks, nearest elements with "
                                    "ties away, stochastic E4M3 scales); remove it", getattr(self, key)))
        return issues

    def config(self) -> QuantConfig | Eden:
        """The role's format and options (axis unset: the backward binds it to the last axis of
        the operand matrix, which is its GEMM's reduction axis), or its EDEN quantizer."""
        if self.eden is not None:
            return Eden(self.eden.group, self.eden.block_max, self.eden.scale_max, self.seed or 0)
        spec = registry.get(self.format)
        opts: dict[str, Any] = {"granularity": self.granularity, "block_size": self.block_size,
                                "block_shape": self.block_shape, "axis": None,
                                "rounding": ROLE_ROUNDING[self.rounding],
                                "seed": (self.seed or 0) if self.rounding == "stochastic" else None}
        opts |= {o: getattr(self, o) for o in ("scale_rule", "scale_dtype", "four_over_six",
                                               "global_bound", "four_over_six_order")
                 if o in spec.options}
        return QuantConfig.from_options(spec, opts)


class BackwardRoles(StrictModel):
    """The quantization of each operand of the backward GEMMs (a role left out stays unquantized)."""

    grad: RoleQuant | None = Field(
        None, description="the output gradient G: along the output features for dgrad, along the "
        "tokens for wgrad")
    weight: RoleQuant | Literal["forward"] | None = Field(
        None, description='W in dgrad, along the output features; "forward" = the forward\'s '
        "quantized weight as it is (one copy for both orientations: exact with 2D tiles)")
    input: RoleQuant | None = Field(None, description="X in wgrad, along the tokens")
    grad_wgrad: RoleQuant | Literal["same"] | None = Field(
        "same", description='G in wgrad only, along the tokens: "same" (default) = the grad role; '
        "null = unquantized (torchao's wgrad_with_hp); or its own role")

    @field_validator("weight", mode="before")
    @classmethod
    def _weight_word(cls, value: object) -> Any:
        if isinstance(value, str) and value != "forward":
            raise problems_error([Issue((), 'expected "forward" or a role object such as '
                                        '{"format": "nvfp4"}', value, ["forward"],
                                        registry.suggest(value, ["forward"]))])
        return value


class WgradHadamard(StrictModel):
    """A Hadamard rotation of both wgrad operands along the tokens before they are quantized."""

    kind: Literal["random_hadamard", "hadamard"] = Field(
        "random_hadamard", description="random_hadamard = random signs then H (Transformer "
        "Engine's RHT); hadamard = H alone")
    block_size: PosInt = Field(16, description="tokens per rotated block (a power of two)")
    seed: Int | None = Field(None, description="random_hadamard: the seed of the signs (default 0)")
    signs: list[Literal[1, -1]] | None = Field(
        None, description="random_hadamard: a fixed sign vector of block_size entries (a stack's "
        "own, e.g. Transformer Engine's); null = random_signs(block_size, seed)")
    redraw: StrictBool = Field(
        False, description="random_hadamard: new signs for every backward call, drawn from the "
        "site's stream of seed (Quartet II's re-randomized rotation); false = one fixed vector")

    @model_validator(mode="after")
    def _check(self) -> WgradHadamard:
        issues = []
        if not is_power_of_two(self.block_size):
            issues.append(Issue(("block_size",), "a Hadamard block must be a power of two",
                                self.block_size, hint=" (e.g. 16)"))
        for key in ("seed", "signs"):
            if getattr(self, key) is not None and self.kind != "random_hadamard":
                issues.append(Issue((key,), "only used with kind 'random_hadamard'", getattr(self, key)))
        if self.redraw and self.kind != "random_hadamard":
            issues.append(Issue(("redraw",), "only used with kind 'random_hadamard'", True))
        if self.redraw and self.signs is not None:
            issues.append(Issue(("redraw",), "re-drawn signs replace a fixed vector; give signs or "
                                "redraw, not both", True))
        if self.signs is not None:
            if self.seed is not None:
                issues.append(Issue(("seed",), "give seed or signs, not both", self.seed))
            if len(self.signs) != self.block_size:
                issues.append(Issue(("signs",), f"needs block_size ({self.block_size}) entries, "
                                    f"got {len(self.signs)}"))
        if issues:
            raise problems_error(issues)
        return self


def hadamard_spec(spec: WgradHadamard | None) -> Hadamard | None:
    """The core's Hadamard of a wgrad_hadamard spec (None when there is none)."""
    if spec is None:
        return None
    return Hadamard(spec.kind, spec.block_size, spec.seed or 0,
                    None if spec.signs is None else tuple(spec.signs), spec.redraw)
