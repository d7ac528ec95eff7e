"""Presets: named recipes of the deployment stacks, written into a policy as `"preset": "<stack>/<scheme>"`.

A preset is explicit policy content (quantize rules with their names and ignore lists, calibration
settings, noise) that reproduces what a stack computes. Loading a policy expands it (`expand`), so
`policy explain` prints the rules it brings, and the user's own fields are merged over it:

- a top-level key the user gives replaces the preset's value of that key, except that objects
  merge key by key (deeply) and lists of objects merge by ``name``;
- a user quantize rule whose ``name`` is the name of a preset rule changes that rule (its fields
  merged over the preset rule's, in place); every other user rule comes after the preset's rules,
  so it wins where it selects the same site and tensor (a later rule overrides an earlier one);
- ``null`` for a top-level key removes the preset's section (``"noise": null`` keeps qerl's
  quantization without its noise).

A preset may take options (`Preset.options`), a stack's own switches such as Transformer Engine's
`disable_rht`: the policy names them in ``"preset_options": {"disable_rht": true}``, each checked
against the preset's list (name, type, allowed values), and the preset's content is built from
them (`Preset.build`) before the user's fields are merged over it.

A preset may also declare its stack's constraints (`Preset.constraints`): shapes the stack refuses,
as data (a named check, the preset rule it applies to, the stack's own words). Transform and plan
check them on the sites each rule selects (`qtransform.pipeline.constraints`), so a preset never
simulates a model its stack would not quantize or serve.

Expansion is idempotent: a policy written back (`Policy.to_json`, which keeps ``preset`` and the
expanded content) loads to an equal policy, because every preset rule has a name.

A stack's presets live in one module of this package (``llm_compressor.py``, ``qerl.py``,
``modelopt.py``), each calling `register_preset`; every module here is imported below, so a new
stack is one new file.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import json
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import Issue, problems_error
from ..sections import SECTIONS

NAME_HELP = "a preset name '<stack>/<scheme>' such as 'llm-compressor/NVFP4'"


@dataclass(frozen=True)
class PresetOption:
    """One switch of a preset (`"preset_options"`): true/false, or one of `choices`."""

    name: str
    default: bool | int | str | None
    help: str  # what it changes, in the stack's words (and its own name for it)
    choices: tuple[int | str | None, ...] | None = None  # None = a boolean switch


# the constraint checks a preset may declare (`qtransform.pipeline.constraints` implements them):
# "groups_divide": the rule's 1D groups divide the input features of every Linear it selects,
# as compressed-tensors requires
CHECKS = ("groups_divide",)


@dataclass(frozen=True)
class Constraint:
    """A shape the preset's stack refuses: `check` (one of CHECKS) must hold on every site the
    preset rule named `rule` selects; `stack_says` is what the stack says when it refuses."""

    rule: str
    check: str
    stack_says: str


@dataclass(frozen=True)
class Preset:
    """One named recipe: the policy content it expands into and what it reproduces.

    A preset with `options` builds its content from their values (`build`); `content` is then
    what the defaults build."""

    name: str  # "<stack>/<scheme>", or a bare name for a recipe of a paper ("qerl")
    reproduces: str  # one sentence: what the expansion computes, after whose code
    checked_against: str  # the stack version the expansion was compared with ("" = none)
    content: Mapping[str, Any]  # policy sections as JSON data (no "version", no "preset")
    options: tuple[PresetOption, ...] = ()
    build: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    constraints: tuple[Constraint, ...] = ()  # what its stack refuses (see Constraint)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}

    def content_for(self, options: Mapping[str, Any] | None) -> Mapping[str, Any]:
        """The content with these options (validated, see `check_options`) over the defaults."""
        if not options or self.build is None:
            return self.content
        return self.build({**self.defaults(), **options})


PRESETS: dict[str, Preset] = {}


def register_preset(preset: Preset) -> Preset:
    """Add a preset, so that `{"preset": preset.name}` in a policy expands into its content.

    Args:
        preset: its name must be new (case-insensitively), its content's keys policy sections,
            and every item of a list section (each quantize rule) named: a user's rule of that
            name changes it (see the module docstring).

    Example::

        register_preset(Preset("my-stack/W4", "my stack's int4 weights", "",
                               {"quantize": [{"name": "my-stack/W4 weights", "format": "int4"}]}))
    """
    key = preset.name.lower()
    if bool(preset.options) != (preset.build is not None):
        raise ValueError(f"preset {preset.name!r}: options and build come together")
    if preset.build is not None and dict(preset.build(preset.defaults())) != dict(preset.content):
        raise ValueError(f"preset {preset.name!r}: content must be what build() makes of the defaults")
    if key in {k.lower() for k in PRESETS}:
        raise ValueError(f"preset {preset.name!r} is registered already")
    unknown = [k for k in preset.content if k not in SECTIONS]
    if unknown:
        raise ValueError(f"preset {preset.name!r}: {unknown} are not policy sections "
                         f"({', '.join(SECTIONS)})")
    for key, value in preset.content.items():
        if isinstance(value, list) and not all(isinstance(v, Mapping) and v.get("name") for v in value):
            raise ValueError(f"preset {preset.name!r}: every item of {key!r} needs a name, so that a "
                             "user's rule of that name can change it")
    rules = {r.get("name") for r in preset.content.get("quantize") or ()}
    for c in preset.constraints:
        if c.rule not in rules or c.check not in CHECKS:
            raise ValueError(f"preset {preset.name!r}: constraint {c.check!r} on {c.rule!r} names "
                             f"no quantize rule of the preset or no check ({', '.join(CHECKS)})")
    PRESETS[preset.name] = preset
    return preset


def preset_names() -> list[str]:
    """The registered presets' names, sorted (what `qtransform policy presets` lists)."""
    return sorted(PRESETS, key=str.lower)


def find_preset(name: str) -> Preset | None:
    """The preset of that name, case-insensitively ('llm-compressor/nvfp4' is NVFP4), or None."""
    by_key = {k.lower(): p for k, p in PRESETS.items()}
    return by_key.get(name.lower())


def own_entries(rule_name: str | None) -> frozenset[str]:
    """The targets and ignore entries a preset itself gives the rule of that name ("<preset>
    <part>"): a stack skips those silently where a model has no such module (llm-compressor's
    `lm_head`, MoE patterns on a dense model), so selection treats them leniently."""
    if not rule_name:
        return frozenset()
    preset = find_preset(rule_name.split(" ", 1)[0])  # preset names hold no space
    if preset is None:
        return frozenset()
    return frozenset(entry for rules in preset.content.values() if isinstance(rules, list)
                     for rule in rules if isinstance(rule, Mapping) and rule.get("name") == rule_name
                     for key in ("targets", "ignore") for entry in rule.get(key) or ())


def constraints_of(rule_name: str | None) -> tuple[Constraint, ...]:
    """The constraints a preset declares on its rule of that name ("<preset> <part>")."""
    if not rule_name:
        return ()
    preset = find_preset(rule_name.split(" ", 1)[0])  # preset names hold no space
    if preset is None:
        return ()
    return tuple(c for c in preset.constraints if c.rule == rule_name)


def suggestion(name: str) -> str:
    """A ' (did you mean X?)' hint for a misspelt preset name, or ''."""
    lowered = {k.lower(): k for k in PRESETS}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""


def check_options(preset: Preset, options: Any) -> dict[str, Any]:
    """The `preset_options` of a policy, checked against the preset's switches (a PydanticCustomError
    naming every unknown option and wrong value)."""
    if options is None:
        return {}
    known = {o.name: o for o in preset.options}
    if not isinstance(options, Mapping):
        raise problems_error([Issue(("preset_options",), "expected an object of the preset's options",
                                    options, sorted(known) or None)])
    issues = []
    for name, value in options.items():
        option = known.get(name)
        if option is None:
            issues.append(Issue(("preset_options", name), f"not an option of preset {preset.name}"
                                + ("" if known else " (it has none)"), name, sorted(known) or None))
        elif option.choices is None and not isinstance(value, bool):
            issues.append(Issue(("preset_options", name), "expected true or false", value))
        elif option.choices is not None and value not in option.choices:
            issues.append(Issue(("preset_options", name), "not an allowed value", value,
                                [json.dumps(c) for c in option.choices]))
    if issues:
        raise problems_error(issues)
    return dict(options)


def expand(data: Mapping[str, Any], chosen: Preset | Sequence[Preset]) -> dict[str, Any]:
    """`data` (a policy's JSON data naming the presets `chosen`) with the presets' contents, built
    with its `preset_options`, merged under it: each preset over the one before (a later preset's
    rule wins where it selects the same site and tensor), the policy's own fields over them all.
    An option goes to every preset that has it, and must be one of some preset's."""
    chosen = [chosen] if isinstance(chosen, Preset) else list(chosen)
    options = data.get("preset_options")
    if options is not None and len(chosen) > 1 and isinstance(options, Mapping):
        known = {o.name for p in chosen for o in p.options}
        unknown = [name for name in options if name not in known]
        if unknown:
            raise problems_error([Issue(("preset_options", unknown[0]), "not an option of presets "
                                        + ", ".join(p.name for p in chosen), unknown[0],
                                        sorted(known) or None)])
    out: dict[str, Any] = {}
    used: dict[str, Any] = {}
    for preset in chosen:
        own = options if len(chosen) == 1 or not isinstance(options, Mapping) else {
            k: v for k, v in options.items() if k in {o.name for o in preset.options}} or None
        checked = check_options(preset, own)
        used |= checked
        for key, value in preset.content_for(checked).items():
            out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
    for key, value in data.items():
        if key in ("preset", "preset_options"):
            continue
        if value is None and key in out:
            del out[key]
        else:
            out[key] = merge(out[key], value) if key in out else copy.deepcopy(value)
    out["preset"] = chosen[0].name if len(chosen) == 1 else [p.name for p in chosen]
    if used:
        out["preset_options"] = used
    return out


def merge(base: Any, over: Any) -> Any:
    """`over` merged over `base`: objects key by key, lists of named objects by name (a named item
    changes the base item of that name, others are appended), anything else replaced."""
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(over, list) and _named(base):
        out_list = list(base)
        index = {item["name"]: i for i, item in enumerate(base)}
        for item in over:
            name = item.get("name") if isinstance(item, Mapping) else None
            if isinstance(name, str) and name in index:
                out_list[index[name]] = merge(base[index[name]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(over)


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, Mapping) and isinstance(i.get("name"), str) for i in items)


def describe(names: str | Sequence[str], options: Mapping[str, Any] | None = None) -> str:
    """The paragraph `policy explain` starts with for a policy expanded from presets."""
    chosen = [PRESETS[n] for n in ([names] if isinstance(names, str) else names)]
    parts = []
    for preset in chosen:
        checked = f" Checked against {preset.checked_against}." if preset.checked_against else ""
        parts.append(f"Preset {preset.name}: {preset.reproduces}.{checked}")
    given = ", ".join(f"{k}={json.dumps(v)}" for k, v in (options or {}).items())
    switches = f" Options: {given}." if given else ""
    order = (" Each preset is merged over the one before it (its rules win where they select the "
             "same module and tensor).") if len(chosen) > 1 else ""
    return (" ".join(parts) + f"{switches}{order} It expands into the rules and "
            "sections below; the policy's own fields are merged over it (a quantize rule named "
            "like a preset rule changes that rule, other rules come after the preset's and win "
            "where they select the same module and tensor, null removes a section).")


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
