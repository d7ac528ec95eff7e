"""A policy in plain words: what each section will do, before anything runs."""

from __future__ import annotations

from qtransform.core.schedule import Schedule as NoiseSchedule
from qtransform.core.schedule import stage_values
from qtransform.formats import registry

from .aqn import NoiseSpec, Schedule
from .base import Selected
from .policy import HWErrorSpec, InstrumentSpec, Policy, QuantRule
from .selectors import Entry, Selector, format_layers

_SCALES = {
    "e8m0": "E8M0 scale",
    "e4m3_fp32": "E4M3 block scale x FP32 tensor scale",
    "fp32": "FP32 scale",
}
_ROUNDING = {
    "rne": "round-half-even",
    "rna": "round-half-away",
    "stochastic": "stochastic rounding",
}
_TENSOR_WORDS = {"weight": "weights", "input": "input activations", "output": "outputs"}
_PHASES = {"train": "during training", "eval": "during evaluation", "both": "in training and eval"}
_SHOWN = 4  # stage sigmas listed before eliding


def _join(words: list[str], last: str = "and") -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def _entry(e: Entry) -> str:
    if e.kind == "class":
        return f"class {e.text}"
    if e.kind == "regex":
        return f"regex {e.text[3:]!r}"
    return e.text if not any(c in e.text for c in "*?[") else repr(e.text)


def describe_selector(section: Selected) -> str:
    """'modules matching class Linear, except lm_head, in layers 10-17,' (a trailing comma closes
    the clauses so the sentence can go on)."""
    sel = Selector.from_section(section)
    text = "modules matching " + _join([_entry(e) for e in sel.targets], "or")
    if sel.ignore:
        text += ", except " + _join([_entry(e) for e in sel.ignore], "or")
    if sel.layers_spec is not None:
        text += f", in layers {sel.layers_spec}"
    return text + ("," if sel.ignore or sel.layers_spec is not None else "")


def element_bits(spec: registry.FormatSpec) -> int:
    """Bits per element: sign + exponent + mantissa, or the integer width."""
    el = spec.element
    return 1 + el.ebits + el.mbits if el.kind == "float" else (el.qmax + 1).bit_length()


def describe_format(rule: QuantRule) -> str:
    """'MXFP4 (E2M1 elements, block 32, E8M0 scale, floor scale rule, round-half-even)'."""
    spec = registry.get(rule.format)
    parts = [f"{spec.element.name.upper().removesuffix('_MX')} elements"]
    if rule.block_shape is not None:
        parts.append(f"{rule.block_shape[0]}x{rule.block_shape[1]} weight tiles")
    else:
        parts.append(f"block {rule.block_size or spec.default_block}")
    parts.append(_SCALES[spec.scale])
    if "scale_rule" in spec.options:
        parts.append(f"{rule.scale_rule} scale rule")
    parts.append(
        _ROUNDING[rule.rounding] + (f" (seed {rule.seed})" if rule.seed is not None else "")
    )
    if "nvfp4_variant" in spec.options:
        parts.append(f"{rule.nvfp4_variant or 'default'} variant")
    if rule.axis is not None:
        parts.append(f"blocks along axis {rule.axis}")
    if rule.zero_saturated_grad:
        parts.append("no gradient through saturated elements")
    return f"{spec.name.upper()} ({', '.join(parts)})"


def scheme(rule: QuantRule) -> str | None:
    """'W4A16', 'W16A4', 'W4A4'; None when outputs are quantized too."""
    chosen = set(rule.tensors)
    if not chosen <= {"weight", "input"}:
        return None
    bits = element_bits(registry.get(rule.format))
    return f"W{bits if 'weight' in chosen else 16}A{bits if 'input' in chosen else 16}"


def tensor_words(rule: QuantRule) -> str:
    """'the weights (W4A16)', 'the input activations (W16A4)', ..."""
    text = "the " + _join([_TENSOR_WORDS[t] for t in rule.tensors])
    name = scheme(rule)
    return f"{text} ({name})" if name else text


def describe_rule(index: int, rule: QuantRule) -> str:
    label = f"Rule {rule.name!r}" if rule.name else f"Rule quantize[{index}]"
    return (
        f"{label} quantizes {tensor_words(rule)} of {describe_selector(rule)} "
        f"to {describe_format(rule)}."
    )


def describe_schedule(s: Schedule) -> str:
    sigmas = stage_values(NoiseSchedule.from_spec(s))
    shown = [f"{v:.3g}" for v in sigmas[:_SHOWN]]
    if len(sigmas) > _SHOWN:
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
        f"{n.resample}, {_PHASES[n.apply_during]}, seed {n.seed}.",
        "  Schedule: " + describe_schedule(n.schedule),
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


def describe_instrument(spec: InstrumentSpec) -> list[str]:
    t = spec.thresholds
    where = "on a shadow copy (outputs unchanged)" if spec.shadow else "on the live forward values"
    return [
        f"Instrumentation: taps the {_join([_TENSOR_WORDS[p] for p in spec.points])} of "
        f"{describe_selector(spec)} and records {', '.join(spec.metrics)} {where}.",
        f"  A site is flagged when SQNR < {t.sqnr_db:g} dB, deadzone > {t.deadzone:.3g}, "
        f"saturation > {t.saturation:.3g} or rel_rmse > {t.relative_error:.3g}.",
    ]


def describe_hw_error(h: HWErrorSpec) -> str:
    formula = "y*(1 + s*z)" if h.error_type == "relative_gaussian" else "y + s*z"
    kind = h.error_type.replace("_", " ")
    matmuls = (
        "attention matmuls included" if h.include_matmuls else "attention matmuls not included"
    )
    return (
        f"Hardware error: {kind} {formula} with s = {h.error_scale:g}, z ~ N(0, 1), on the "
        f"{_TENSOR_WORDS[h.injection_point]} of {describe_selector(h).rstrip(',')}, {_PHASES[h.apply_during]}, "
        f"seed {h.seed} ({matmuls})."
    )


def explain(policy: Policy) -> str:
    """Every section of the policy in plain language, one paragraph each."""
    lines = [describe_rule(i, r) for i, r in enumerate(policy.quantize)]
    if len(policy.quantize) > 1:
        lines.append("A later rule overrides an earlier one for the same module and tensor.")
    if policy.instrument is not None:
        lines += describe_instrument(policy.instrument)
    if policy.noise is not None:
        lines += describe_noise(policy.noise)
    if policy.hw_error is not None:
        lines.append(describe_hw_error(policy.hw_error))
    return "\n".join(lines) if lines else "The policy is empty: it changes nothing."


def summary(policy: Policy) -> str:
    """One line: which sections are present, for `policy validate`."""
    parts = []
    if policy.quantize:
        rules = ", ".join(f"{r.format} {scheme(r) or '+'.join(r.tensors)}" for r in policy.quantize)
        parts.append(f"{len(policy.quantize)} quantize rule(s) ({rules})")
    if policy.instrument is not None:
        parts.append(f"instrument ({len(policy.instrument.metrics)} metrics)")
    if policy.noise is not None:
        s = policy.noise.schedule
        parts.append(f"noise ({s.kind}, sigma_start {s.sigma_start:g}, {s.stages} stages)")
    if policy.hw_error is not None:
        parts.append(f"hw_error ({policy.hw_error.error_type} {policy.hw_error.error_scale:g})")
    return ", ".join(parts) if parts else "empty policy"
