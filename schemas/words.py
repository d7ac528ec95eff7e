"""Shared phrasing for `describe()` of the policy sections: selectors, formats, phases."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qtransform.formats import registry

from .selectors import ROUTER_ENTRY, Entry, Selector

if TYPE_CHECKING:  # the sections import this module
    from .sections.quantize import QuantRule

_SCALES = {
    "e8m0": "E8M0 scale",
    "e4m3_fp32": "E4M3 block scale x FP32 tensor scale",
    "fp32": "FP32 scale",
    "fp32_tensor": "FP32 tensor scale",
}
_ROUNDING = {
    "rne": "round-half-even",
    "rna": "round-half-away",
    "rtz": "round-toward-zero",
    "stochastic": "stochastic rounding",
}
TENSOR_WORDS = {"weight": "weights", "input": "input activations", "output": "outputs",
                "query": "queries", "key": "keys", "value": "values",
                "probs": "attention probabilities"}
PHASES = {"train": "during training", "eval": "during evaluation", "both": "in training and eval",
          "rollout": "only in rollouts (generate(), qtransform.rollout() and rollout weights; never in the training loss or log-probs)"}
SHOWN = 4  # stage sigmas listed before eliding


def join(words: list[str], last: str = "and") -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def _entry(e: Entry) -> str:
    if e.kind == "class":
        return f"class {e.text}"
    if e.kind == "regex":
        return f"regex {e.text[3:]!r}"
    return e.text if not any(c in e.text for c in "*?[") else repr(e.text)


def describe_selector(section: object) -> str:
    """'modules matching class Linear, except lm_head, in layers 10-17,' (a trailing comma closes
    the clauses so the sentence can go on)."""
    sel = Selector.from_section(section)
    text = "modules matching " + join([_entry(e) for e in sel.targets], "or")
    excepted = [_entry(e) for e in sel.ignore]
    if (any(e.kind == "class" and e.text == "Linear" for e in sel.targets)
            and not any(e.text == ROUTER_ENTRY for e in sel.targets)):
        excepted.append(f"MoE routers (kept in high precision unless named, e.g. {ROUTER_ENTRY})")
    if excepted:
        text += ", except " + join(excepted, "or")
    if sel.layers_spec is not None:
        text += f", in layers {sel.layers_spec}"
    return text + ("," if excepted or sel.layers_spec is not None else "")


def element_bits(spec: registry.FormatSpec) -> int:
    """Bits per element: sign + exponent + mantissa, or the integer width."""
    el = spec.element
    return 1 + el.ebits + el.mbits if el.kind == "float" else (el.qmax + 1).bit_length()


_OPTION_WORDS = {"scale_rule": "scale rule", "nvfp4_variant": "variant", "fp8_variant": "variant",
                 "int_range": "integer range"}
_WHOLE = {"channel": "one scale per output channel", "token": "one scale per token",
          "tensor": "one scale per tensor"}


def describe_format(rule: QuantRule) -> str:
    """'MXFP4 (E2M1 elements, block 32, E8M0 scale, floor scale rule, round-half-even)': the
    rule's `QuantConfig`, each choice option of its family in the family's order."""
    cfg = rule.config()
    spec = cfg.spec
    parts = [f"{spec.element.name.upper().removesuffix('_MX')} elements"]
    if cfg.tile:
        parts.append(f"{cfg.tile[0]}x{cfg.tile[1]} weight tiles")
    elif rule.granularity == "head":
        parts.append("one scale per head")
    elif cfg.granularity in _WHOLE:
        parts.append(_WHOLE[cfg.granularity])
    else:
        parts.append(f"block {cfg.block}")
    parts.append(_SCALES[spec.scale])
    for option in cfg.family.options:
        value = getattr(cfg, option)
        if option == "rounding":
            parts.append(_ROUNDING[value] + (f" (seed {cfg.seed})" if cfg.seed is not None else ""))
        elif option in cfg.family.quiet and value == cfg.family.default(option):
            continue
        elif option == "scale_dtype" and spec.family.name == "nvfp4":  # only its two divisions
            where = "the input's dtype" if value == "input" else value
            parts.append(f"2688/amax and amax/6 divided in {where}")
        elif option == "four_over_six":
            parts.append(f"four over six by {value.upper()} (max/6 or max/4 per block)")
        elif option == "global_bound":
            parts.append(f"tensor amax mapped to {value}")
        elif option == "four_over_six_order":
            parts.append(f"four over six decided in {value}'s fp32 order")
        elif option == "scale_dtype":
            parts.append("scales in the input's dtype" if value == "input" else f"{value} scales")
        else:
            parts.append(f"{value} {_OPTION_WORDS.get(option, option.replace('_', ' '))}")
    if cfg.axis is not None:
        parts.append(f"blocks along axis {cfg.axis}")
    if cfg.zero_saturated_grad:
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
    text = "the " + join([TENSOR_WORDS[t] for t in rule.tensors])
    name = scheme(rule)
    return f"{text} ({name})" if name else text


