"""The `quantize` section: ordered rules that fake-quantize weights, inputs or outputs.

Format-dependent options are checked against the format registry, so a new format needs no change
here. A later rule overrides an earlier one for the same (site, tensor).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictBool, StrictStr, field_validator, model_validator

from qtransform.core.backward import MODES, BackwardSpec
from qtransform.core.lora import LORA_HELP
from qtransform.formats import registry
from qtransform.formats.options import CHOICE_OPTIONS, QuantConfig
from qtransform.formats.registry import GRANULARITIES

from ..backward_roles import BackwardRoles, RoleQuant, WgradHadamard, hadamard_spec
from ..base import (
    ATTENTION_TENSORS,
    Fraction,
    Int,
    PosFloat,
    PosInt,
    QuantTensor,
    Selected,
    StrictModel,
    unique,
)
from ..errors import Issue, problems_error
from ..format_fields import (
    FOUR_OVER_SIX_HELP,
    FOUR_OVER_SIX_ORDER_HELP,
    GLOBAL_BOUND_HELP,
    GLOBAL_BOUNDS,
    OPTION_DEFAULTS,
    all_option_values,
    known_format,
    lowered,
)
from ..selectors import compile_entry
from ..words import describe_format, describe_selector, scheme, tensor_words
from . import Section, register_section

OBSERVERS = ("static_minmax", "minmax", "memoryless_minmax")  # llm-compressor 0.14's names
DEFAULT_OBSERVER = "static_minmax"
class ObserverKwargs(StrictModel):
    """llm-compressor's observer_kwargs that qtransform's observers take."""

    averaging_constant: Annotated[Fraction, Field(gt=0)] = Field(
        0.01, description="minmax: weight of the newest batch in the moving average")


BACKWARD_HELP = ('what the backward GEMMs use: dequantized (default) = straight-through with the '
                 "forward's quantized operands, dX = G·Q(W), dW = Gᵀ·Q(X); high_precision = the "
                 "operands before quantization, dX = G·W, dW = Gᵀ·X; quantized = every operand "
                 "fake-quantized along its GEMM's reduction axis (backward_roles, wgrad_hadamard); "
                 "docs/training.md")


class QuantRule(Selected):
    """Fake-quantize the selected tensors of the selected sites to one block format."""

    name: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None, description="the rule's name in plans, logs and reports (unique)")
    format: StrictStr = Field(json_schema_extra={"enum": list(registry.names())},
                              description="a registered format, e.g. mxfp4, nvfp4, int4")
    tensors: list[QuantTensor] = Field(
        default_factory=lambda: ["weight"],
        min_length=1,
        description='a Linear\'s: ["weight"] = W4A16-style, ["input"] = W16A4-style, both = '
        'W4A4-style; or an attention\'s (targets default to ["Attention"]): "key" and "value" '
        '(a KV cache), "query", "probs" (docs/attention.md)',
    )
    granularity: Literal[(*GRANULARITIES, "head")] | None = Field(  # type: ignore[valid-type]
        None, description=(
            "what one scale covers: block (block_size elements along the axis), channel (one "
            "scale per output row of a weight), token (one per row of an activation; for "
            "attention tensors one per token and head), head (attention tensors: one per head), "
            "tensor (one for the whole tensor), tile (2D, block_shape); null = block of the "
            "format's default size, or tile when block_shape is given"))
    block_size: PosInt | None = Field(None, description="elements per block; null = format default")
    block_shape: tuple[PosInt, PosInt] | None = Field(None, description="2D weight tiles")
    scale_rule: StrictStr = Field(
        OPTION_DEFAULTS["scale_rule"], json_schema_extra={"enum": all_option_values("scale_rule")},
        description="how an MX block's shared exponent is chosen (MX formats only)",
    )
    rounding: StrictStr = Field(
        OPTION_DEFAULTS["rounding"], json_schema_extra={"enum": all_option_values("rounding")},
        description="rne: half to even; rna: half away from zero; rtz: toward zero (truncation); "
        "stochastic (see seed)",
    )
    nvfp4_variant: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("nvfp4_variant"), None]},
        description="NVFP4 only: whose fp32 order of operations; null = default",
    )
    int_range: StrictStr = Field(
        OPTION_DEFAULTS["int_range"], json_schema_extra={"enum": all_option_values("int_range")},
        description=("int4/int8 only: restricted = scale amax/qmax, codes in [-qmax, qmax]; "
                     "full = compressed-tensors' amax/(qmax+0.5), codes in [-qmax-1, qmax]"),
    )
    scale_dtype: StrictStr = Field(
        OPTION_DEFAULTS["scale_dtype"], json_schema_extra={"enum": all_option_values("scale_dtype")},
        description=("int and fp8 formats: the float the scale and x/scale are rounded to; "
                     "nvfp4 (compressed-tensors variant): the float 2688/amax and amax/6 are "
                     "divided in; input = the tensor's own dtype (compressed-tensors on a bf16 model)"),
    )
    fp8_variant: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("fp8_variant"), None]},
        description=("fp8 formats only: whose order of operations; null = default "
                     "(compressed-tensors': x / (amax / max)), modelopt (x * (max / amax))"),
    )
    four_over_six: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("four_over_six"), None]},
        description=FOUR_OVER_SIX_HELP)
    four_over_six_order: StrictStr | None = Field(
        None, json_schema_extra={"enum": [*all_option_values("four_over_six_order"), None]},
        description=FOUR_OVER_SIX_ORDER_HELP)
    global_bound: Literal[GLOBAL_BOUNDS] | None = Field(  # type: ignore[valid-type]
        None, description=GLOBAL_BOUND_HELP)
    zero_saturated_grad: StrictBool = Field(
        False, description="no gradient through saturated elements (straight-through otherwise)")
    axis: Int | None = Field(None, description="blocking axis; null = the reduction axis")
    seed: Int | None = Field(None, description="seed of stochastic rounding")
    lora: Literal["beside", "merged"] = Field("beside", description=LORA_HELP)
    scale_source: Literal["dynamic", "static", "fixed"] = Field(
        "dynamic", description="activations: dynamic = the tensor-level scale (NVFP4's global "
        "scale) from each call; static = calibrated once (calibration=, --calib), then frozen; "
        "fixed = fixed_scale, as an engine uses a scale it was given (vLLM's 1.0 for a KV cache "
        "whose checkpoint has none)")
    fixed_scale: PosFloat | None = Field(
        None, description='scale_source "fixed": the scale itself (x is divided by it: for FP8, '
        "1.0 casts x as it is)")
    observer: Literal[OBSERVERS] | None = Field(  # type: ignore[valid-type]
        None, description="static scales: how calibration batches become the scale; "
        "static_minmax (default) = min/max over the whole set, minmax = llm-compressor's moving "
        "average, memoryless_minmax = the last batch")
    observer_kwargs: ObserverKwargs | None = Field(
        None, description='observer options, as llm-compressor names them: {"averaging_constant": '
        "0.01} (minmax only)")
    global_scale: Literal["token", "tensor"] | None = Field(
        None, description="NVFP4 activations with dynamic scales: token (default) = one global "
        "scale per token row, so a sequence's outputs never depend on its batch; tensor = the "
        "amax of the whole call (outputs then depend on the other sequences of the batch)")
    backward: Literal[MODES] = Field("dequantized", description=BACKWARD_HELP)  # type: ignore[valid-type]
    backward_roles: BackwardRoles | None = Field(
        None, description='backward "quantized": the format of each operand role (grad, weight, '
        "input); null = all three in the rule's format")
    wgrad_hadamard: WgradHadamard | None = Field(
        None, description='backward "quantized": rotate both wgrad operands along the tokens '
        "before quantizing them")
    dgrad_hadamard: WgradHadamard | None = Field(
        None, description='backward "quantized": rotate both dgrad operands (G and Wᵀ) along the '
        "output features before quantizing them (FP-Quant's mxfp4 backward); the block must divide them")
    share_scale: Literal["tensor", "fused"] | list[Annotated[list[StrictStr], Field(min_length=1)]] = Field(
        "tensor", description="weights of two-level formats (NVFP4): tensor = one global scale "
        "per weight; fused = one per group of siblings a serving stack fuses (q/k/v of an "
        "attention, gate/up of an MLP), the largest amax of the group; or a list of explicit "
        "groups, each a list of site-name patterns")

    _format_lower = field_validator("format", mode="before")(lowered)
    _format_known = field_validator("format")(known_format)

    @field_validator("tensors")
    @classmethod
    def _tensors_unique(cls, values: list[str]) -> list[str]:
        return unique(values)

    @model_validator(mode="before")
    @classmethod
    def _attention_targets(cls, data: Any) -> Any:
        """A rule on attention tensors targets every attention module unless it says otherwise."""
        if (isinstance(data, dict) and "targets" not in data and isinstance(data.get("tensors"), list)
                and any(t in ATTENTION_TENSORS for t in data["tensors"])):
            return {**data, "targets": ["Attention"]}
        return data

    @property
    def attention(self) -> bool:
        """Whether the rule quantizes an attention's tensors (else a Linear's)."""
        return any(t in ATTENTION_TENSORS for t in self.tensors)

    @model_validator(mode="after")
    def _options_fit_format(self) -> QuantRule:
        spec = registry.get(self.format)
        issues = _option_issues(self, spec) + _block_issues(self, spec) + _attention_issues(self)
        if self.lora != "beside" and "weight" not in self.tensors:
            issues.append(Issue(("lora",), "only used when the rule quantizes weights "
                                '(tensors must include "weight")', self.lora))
        if self.seed is not None and self.rounding != "stochastic":
            issues.append(Issue(("seed",), "only used with rounding 'stochastic'", self.seed))
        issues += _backward_issues(self)
        if not issues:  # the scale fields are checked against a valid format config
            issues += _scale_issues(self, spec)
        if issues:
            raise problems_error(issues)
        return self

    def config(self) -> QuantConfig:
        """The rule's format and options as the canonical `QuantConfig` (axis unset: bound per
        site to its reduction axis by the pass and the scans). Options the format does not take
        (scale_rule outside MX, nvfp4_variant outside NVFP4) are left to the format's default."""
        spec = registry.get(self.format)
        opts: dict[str, Any] = {
            "granularity": "tensor" if self.granularity == "head" else self.granularity,
            "block_size": self.block_size, "block_shape": self.block_shape, "axis": self.axis,
            "zero_saturated_grad": self.zero_saturated_grad, "seed": self.seed,
        }
        opts |= {o: getattr(self, o) for o in CHOICE_OPTIONS if o in spec.options}
        return QuantConfig.from_options(spec, opts)


    def backward_spec(self) -> BackwardSpec | None:
        """What the backward GEMMs of the rule's Linear sites compute; None for the default
        (straight-through through the forward's quantized operands)."""
        if self.backward == "dequantized":
            return None
        if self.backward == "high_precision":
            return BackwardSpec("high_precision")
        roles = self.backward_roles
        if roles is None:
            own = RoleQuant(format=self.format).config()
            return BackwardSpec("quantized", own, own, own, hadamard_spec(self.wgrad_hadamard),
                                dgrad_hadamard=hadamard_spec(self.dgrad_hadamard))
        weight = roles.weight if isinstance(roles.weight, str) or roles.weight is None else roles.weight.config()
        grad_wgrad = (roles.grad_wgrad if isinstance(roles.grad_wgrad, str) or roles.grad_wgrad is None
                      else roles.grad_wgrad.config())
        requantize = frozenset(role for role in ("weight", "input")
                               if isinstance(quant := getattr(roles, role), RoleQuant) and quant.source == "forward")
        return BackwardSpec("quantized", roles.grad and roles.grad.config(), weight,
                            roles.input and roles.input.config(), hadamard_spec(self.wgrad_hadamard),
                            grad_wgrad, requantize, hadamard_spec(self.dgrad_hadamard))


def _attention_issues(rule: QuantRule) -> list[Issue]:
    """A rule quantizes a Linear's tensors or an attention's, not both; "head" granularity is
    for attention tensors; a fixed scale has its value, and a value has scale_source "fixed"."""
    issues = []
    kinds = {t in ATTENTION_TENSORS for t in rule.tensors}
    if len(kinds) > 1:
        issues.append(Issue(("tensors",), "mixes a Linear's tensors (weight, input, output) with "
                            "an attention's (query, key, value, probs); write one rule for each",
                            list(rule.tensors)))
    if rule.granularity == "head" and not rule.attention:
        issues.append(Issue(("granularity",), "one scale per head is for attention tensors "
                            '(query, key, value); use "channel" or "token" on a Linear', "head"))
    if rule.granularity == "head" and "probs" in rule.tensors:
        issues.append(Issue(("granularity",), 'the probabilities take "tensor", "token" or '
                            "blocks, not one scale per head", "head"))
    if rule.scale_source == "fixed" and rule.fixed_scale is None:
        issues.append(Issue(("fixed_scale",), 'scale_source "fixed" needs the scale: add '
                            '"fixed_scale": 1.0 (or the value the engine uses)'))
    if rule.fixed_scale is not None and rule.scale_source != "fixed":
        issues.append(Issue(("fixed_scale",), 'only used with scale_source "fixed"', rule.fixed_scale))
    if rule.backward != "dequantized" and rule.attention:
        issues.append(Issue(("backward",), "changes a Linear's GEMMs; attention tensors take the "
                            'default "dequantized"', rule.backward))
    return issues


def _backward_issues(rule: QuantRule) -> list[Issue]:
    """backward_roles / wgrad_hadamard only with backward "quantized"; what a non-default
    backward cannot combine with; tiles only for the weight role."""
    issues = []
    for key in ("backward_roles", "wgrad_hadamard", "dgrad_hadamard"):
        if getattr(rule, key) is not None and rule.backward != "quantized":
            issues.append(Issue((key,), 'only used with backward "quantized"',
                                getattr(rule, key).model_dump(exclude_defaults=True), hint=' (set backward: "quantized")'))
    if rule.backward == "dequantized":
        return issues
    if not {"weight", "input"} & set(rule.tensors):
        issues.append(Issue(("backward",), "changes the backward of a Linear's GEMMs: tensors "
                            'must include "weight" or "input"', rule.backward))
    if rule.zero_saturated_grad:
        issues.append(Issue(("zero_saturated_grad",), "is part of the straight-through backward "
                            f'(backward "dequantized"); backward {rule.backward!r} computes its '
                            "own gradients", True))
    if rule.lora == "merged":
        issues.append(Issue(("lora",), f'backward {rule.backward!r} is not available with lora '
                            '"merged"; use lora "beside"', rule.lora))
    roles = rule.backward_roles
    if roles is not None:
        for role in ("grad", "input", "grad_wgrad"):
            quant = getattr(roles, role)
            if isinstance(quant, RoleQuant) and (quant.block_shape is not None or quant.granularity == "tile"):
                issues.append(Issue(("backward_roles", role, "block_shape"), "2D tiles are for the "
                                    "weight role only; use block_size", quant.block_shape))
        for role in ("grad", "grad_wgrad"):
            quant = getattr(roles, role)
            if isinstance(quant, RoleQuant) and quant.source == "forward":
                issues.append(Issue(("backward_roles", role, "source"), "the gradient has no "
                                    'forward copy; "forward" is for the weight and input roles', "forward"))
    return issues


def observer_name(rule: QuantRule) -> str | None:
    """The observer a rule's static scales use (None for dynamic scales)."""
    if rule.scale_source != "static":
        return None
    return rule.observer or DEFAULT_OBSERVER


def activation_global_scale(rule: QuantRule) -> str | None:
    """How the rule's activations get their tensor-level scale: "static", "token" (one per row)
    or "tensor" (the whole call); None when the format has none. A two-level format's global
    scale is per token unless the rule says otherwise; a granularity "tensor" scale, dynamic,
    is the whole call's (that is what the granularity asks for)."""
    if not _tensor_scaled(rule):
        return None
    if rule.scale_source in ("static", "fixed"):
        return rule.scale_source
    if not _two_level(rule):
        return "tensor"
    return rule.global_scale or "token"


def _tensor_scaled(rule: QuantRule) -> bool:
    """Whether the rule's format has a tensor-level scale: NVFP4's global scale (two-level) or
    the one fp32 scale of granularity "tensor"."""
    cfg = rule.config()
    return bool(cfg.family.per_tensor(cfg))


def _two_level(rule: QuantRule) -> bool:
    """Whether the tensor-level scale is a second level above block scales (NVFP4)."""
    return _tensor_scaled(rule) and rule.config().granularity != "tensor"


def _scale_issues(rule: QuantRule, spec: registry.FormatSpec) -> list[Issue]:
    """scale_source / observer / global_scale / share_scale against the tensors and format."""
    issues = []
    acts = [t for t in rule.tensors if t != "weight"]
    two_level, scaled = _two_level(rule), _tensor_scaled(rule)
    if rule.scale_source in ("static", "fixed"):
        kind = rule.scale_source
        if not acts:
            issues.append(Issue(("scale_source",), f"{kind} scales are for activations: tensors "
                                'must include "input" or "output" (a weight is its own scale), or '
                                "an attention's tensors"))
        if not scaled:
            issues.append(Issue(("scale_source",), f"{spec.name} has no tensor-level scale to "
                                f"{'calibrate' if kind == 'static' else 'fix'} here (its block "
                                "scales are computed per call); such scales apply to nvfp4 (the "
                                'global scale) and granularity "tensor" (or "head")', kind))
        if rule.global_scale is not None:
            issues.append(Issue(("global_scale",), f"a {kind} scale is one global scale; remove "
                                "global_scale", rule.global_scale))
    if rule.observer is not None and rule.scale_source != "static":
        issues.append(Issue(("observer",), 'only used with scale_source "static"', rule.observer))
    if rule.observer_kwargs is not None and observer_name(rule) != "minmax":
        issues.append(Issue(("observer_kwargs",), 'only used with observer "minmax" (the moving '
                            "average)", rule.observer_kwargs.model_dump()))
    if rule.global_scale is not None and rule.scale_source == "dynamic":
        if not acts:
            issues.append(Issue(("global_scale",), 'applies to activations: tensors must include '
                                '"input" or "output"', rule.global_scale))
        if not two_level:
            issues.append(Issue(("global_scale",), f"{spec.name} has no global scale above its "
                                "block scales (two-level nvfp4 only; a per-token scale of other "
                                'formats is granularity "token")', rule.global_scale))
    if rule.share_scale != "tensor":
        if "weight" not in rule.tensors:
            issues.append(Issue(("share_scale",), 'shares weight scales: tensors must include '
                                '"weight"', rule.share_scale))
        if not scaled:
            issues.append(Issue(("share_scale",), f"{spec.name} has no tensor-level scale to "
                                'share (nvfp4 two-level, or granularity "tensor")', rule.share_scale))
        if rule.lora == "merged":
            issues.append(Issue(("share_scale",), 'a shared scale of merged LoRA weights (lora '
                                '"merged") is not supported; use lora "beside" or share_scale '
                                '"tensor"', rule.share_scale))
        if isinstance(rule.share_scale, list):
            issues += _group_pattern_issues(rule.share_scale)
    return issues


def _group_pattern_issues(groups: list[list[str]]) -> list[Issue]:
    issues = []
    for g, group in enumerate(groups):
        for k, text in enumerate(group):
            try:
                compile_entry(text)
            except ValueError as exc:
                issues.append(Issue(("share_scale", g, k), str(exc), text))
    return issues


def _option_issues(rule: QuantRule, spec: registry.FormatSpec) -> list[Issue]:
    """scale_rule / rounding / nvfp4_variant against the values this format allows."""
    issues = []
    for option in CHOICE_OPTIONS:
        value = getattr(rule, option)
        if option == "global_bound" and value is not None:  # an int in policies
            value = str(value)
        allowed = spec.options.get(option) or (
            (OPTION_DEFAULTS[option],) if option in OPTION_DEFAULTS else ()
        )
        if value is None or value in allowed:
            continue
        if not allowed:
            issues.append(Issue((option,), f"{spec.name} takes no {option}; remove it", value))
            continue
        why = (
            f"not supported by {spec.name}"
            if value in all_option_values(option)
            else "unknown value"
        )
        issues.append(Issue((option,), why, value, allowed, registry.suggest(value, allowed)))
    return issues


def _granularity_issues(rule: QuantRule, spec: registry.FormatSpec) -> list[Issue]:
    """The format's family takes the granularity; a whole-row or whole-tensor scale takes no
    block option; "channel" is for weights and "token" for activations."""
    g = rule.granularity
    if g is None:
        return []
    allowed = spec.family.granularities
    if g == "head" and "tensor" in allowed:  # one tensor scale per head
        g = "tensor"
    if g not in allowed:
        return [Issue(("granularity",), f"not available for {spec.name} (its scales are "
                      f"{spec.scale})", g, list(allowed))]
    issues = []
    if g in ("channel", "token", "tensor"):
        for key in ("block_size", "block_shape"):
            if getattr(rule, key) is not None:
                issues.append(Issue((key,), f"granularity {g!r} has one scale per "
                                    f"{'tensor' if g == 'tensor' else 'whole row'}; remove it",
                                    getattr(rule, key)))
    if g == "block" and rule.block_shape is not None:
        issues.append(Issue(("block_shape",), "2D tiles need granularity 'tile' (or null)"))
    if g == "tile" and rule.block_size is not None:
        issues.append(Issue(("block_size",), "granularity 'tile' takes block_shape"))
    if g == "tile" and rule.block_shape is None and list(rule.tensors) != ["weight"]:
        issues.append(Issue(("granularity",), _TILES_FOR_WEIGHTS, list(rule.tensors)))
    if g == "channel" and list(rule.tensors) != ["weight"]:
        issues.append(Issue(("granularity",), 'one scale per output channel is for weights: '
                            'set tensors to ["weight"], and use "token" in a rule for inputs '
                            'or outputs', list(rule.tensors)))
    if g == "token" and "weight" in rule.tensors:
        issues.append(Issue(("granularity",), 'one scale per token is for activations: use '
                            '"channel" in a rule for weights', list(rule.tensors)))
    return issues


def _block_issues(rule: QuantRule, spec: registry.FormatSpec) -> list[Issue]:
    """Block sizes the format allows; 2D tiles only for weights and without block_size/axis."""
    blocks = [str(b) for b in spec.allowed_blocks] if spec.allowed_blocks else None
    issues = _granularity_issues(rule, spec)
    if rule.block_size is not None and not _block_ok(spec, rule.block_size):
        issues.append(
            Issue(("block_size",), f"not a block size of {spec.name}", rule.block_size, blocks)
        )
    if rule.block_shape is None:
        return issues
    if list(rule.tensors) != ["weight"]:
        issues.append(Issue(("block_shape",), _TILES_FOR_WEIGHTS, list(rule.tensors)))
    if rule.block_size is not None:
        issues.append(Issue(("block_shape",), "give block_size or block_shape, not both"))
    if rule.axis is not None:
        issues.append(Issue(("axis",), "a 2D tile has no blocking axis; remove axis", rule.axis))
    for k, dim in enumerate(rule.block_shape):
        if not _block_ok(spec, dim):
            issues.append(
                Issue(("block_shape", k), f"not a block size of {spec.name}", dim, blocks)
            )
    return issues


_TILES_FOR_WEIGHTS = '2D tiles apply to weights only; set tensors to ["weight"] or use block_size'


def _block_ok(spec: registry.FormatSpec, block: int) -> bool:
    try:
        spec.check_block(block)
    except ValueError:
        return False
    return True


def _names_unique(rules: list[QuantRule]) -> list[QuantRule]:
    """Rule names label plans and reports: two rules with one name would be indistinguishable."""
    seen: set[str] = set()
    issues = []
    for i, rule in enumerate(rules):
        if rule.name is None:
            continue
        if rule.name in seen:
            issues.append(Issue((i, "name"), "rule names must be unique", rule.name))
        seen.add(rule.name)
    if issues:
        raise problems_error(issues)
    return rules


def describe_rule(index: int, rule: QuantRule) -> str:
    label = f"Rule {rule.name!r}" if rule.name else f"Rule quantize[{index}]"
    merged = (" LoRA adapters on these weights are merged before quantization: every forward "
              "and the rollout weights compute quant(W + s B A) (lora: merged)."
              if rule.lora == "merged" else "")
    return (
        f"{label} quantizes {tensor_words(rule)} of {describe_selector(rule)} "
        f"to {describe_format(rule)}.{merged}{_scale_words(rule)}{_backward_words(rule)}"
    )


def _backward_words(rule: QuantRule) -> str:
    """What the backward GEMMs compute, when that is not the straight-through default."""
    spec = rule.backward_spec()
    if spec is None:
        return ""
    if spec.mode == "high_precision":
        return (" The backward GEMMs use the operands before quantization (dX = G·W, dW = Gᵀ·X: "
                "backward high_precision).")
    return (f" The backward GEMMs quantize their operands along their reduction axes: "
            f"{spec.describe()[len('backward quantized ('):-1]}.")


def _scale_words(rule: QuantRule) -> str:
    """Where the rule's tensor-level scales come from, when that is not each tensor's own amax."""
    words = []
    source = activation_global_scale(rule) if any(t != "weight" for t in rule.tensors) else None
    if source == "static":
        words.append(f"Activation global scales are static: calibrated with the "
                     f"{observer_name(rule)} observer"
                     + (f" (averaging constant {rule.observer_kwargs.averaging_constant})"
                        if rule.observer_kwargs else "")
                     + ", then frozen (training and noise leave them unchanged).")
    elif source == "fixed":
        words.append(f"The scale is fixed at {rule.fixed_scale:g} (x divided by it), as an engine "
                     "uses a scale it was given.")
    elif source == "token":
        words.append("Activation global scales are per token (each row its own): a sequence's "
                     "outputs do not depend on its batch.")
    elif source == "tensor":
        words.append("Activation global scales come from the whole tensor of each call: a "
                     "sequence's outputs depend on the other sequences in its batch.")
    if rule.share_scale == "fused":
        words.append("Weights the serving stacks fuse (q/k/v of an attention, gate/up of an MLP, "
                     "each expert's gate/up) share one global scale, from the largest amax of "
                     "the group.")
    elif isinstance(rule.share_scale, list):
        groups = "; ".join(", ".join(g) for g in rule.share_scale)
        words.append(f"The weights of each group share one global scale, from the largest amax "
                     f"of the group: {groups}.")
    return "".join(" " + w for w in words)


def describe(rules: list[QuantRule]) -> list[str]:
    lines = [describe_rule(i, r) for i, r in enumerate(rules)]
    if len(rules) > 1:
        lines.append("A later rule overrides an earlier one for the same module and tensor.")
    return lines


def summary(rules: list[QuantRule]) -> str:
    names = ", ".join(f"{r.format} {scheme(r) or '+'.join(r.tensors)}" for r in rules)
    return f"{len(rules)} quantize rule(s) ({names})"


register_section(Section(
    "quantize", Annotated[list[QuantRule], AfterValidator(_names_unique)], [], describe, summary,
    order=0,
    description="fake-quantize rules, in order: a later rule overrides an earlier one for the same site and tensor",
    example=[{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]))
