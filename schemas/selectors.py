"""The selector language shared by every policy section (llm-compressor's vocabulary).

A section selects sites with three fields:

- ``targets``: entries a site must match (any one of them);
- ``ignore``: entries that exclude a site even when a target matches (**ignore beats targets**);
- ``layers``: an optional layer spec such as ``"10-17,20"``; a site outside it, or one that sits
  in no numbered layer (``lm_head``, the final norm), is excluded.

An entry is one of:

- a **class selector**: a bare identifier starting with an uppercase letter (no ``.``, ``*``,
  ``?``). It matches a site whose class name equals it. Names ending in ``Norm`` also match class
  names ending with them (``RMSNorm`` matches ``Qwen2RMSNorm`` and ``LlamaRMSNorm``), so one
  policy serves several model families. ``Linear`` matches every linear site, including GPT-2's
  ``Conv1D`` (kind ``conv1d``) and fused expert parameters (kind ``experts``:
  ``model.layers.0.mlp.experts.gate_up_proj``, one matrix per expert): all are matrix
  multiplications by a weight. The experts class name (``MixtralExperts``) selects the expert
  sites of that class. ``Attention`` matches every attention module (``Qwen2Attention``,
  ``GPT2Attention``, ...: the sites whose query, key, value and probabilities a quantize rule
  reaches); its own class name selects that class.
- **Mixture-of-experts routers** (role ``router``: the modules whose output picks or weighs
  experts, `qtransform.core.sites.router_names`) are reached only by an entry that names them:
  ``Router`` (every router, whatever its class), the router's own class (``MixtralTopKRouter``;
  never the generic ``Linear``, even for an ``nn.Linear`` gate), a glob or a regex matching its
  name (``mlp.gate``). Every other class selector passes them by, because every deployment stack
  keeps routers in high precision (llm-compressor's ``re:.*mlp.gate$``, ModelOpt's disabled
  router quantizers, vLLM's unquantized gate); plans list them as skipped.
- a **regular expression** after ``re:``, applied with ``re.fullmatch`` to the fully-qualified
  module name. This deliberately differs from llm-compressor, which uses ``re.match`` (anchored
  only at the start, so ``re:.*gate`` also matches ``gate_proj`` there). Write ``re:.*gate.*`` to
  match anywhere in the name.
- otherwise a **glob** (``fnmatch``, case-sensitive; ``*`` also crosses dots) matched against the
  whole name or a trailing run of its dotted parts: ``lm_head`` and ``mlp.down_proj`` match
  ``model.layers.3.mlp.down_proj``-style paths without a leading ``*.``.

Across quantize rules, a later rule overrides an earlier one for the same (site, tensor); see
`resolve_quant_rules`.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, Protocol

from qtransform.core.sites import ADAPTER_KEYS, LINEAR_KINDS, REGEX_PREFIX, ROUTER_ROLE

if TYPE_CHECKING:  # base imports this module
    from .base import Selected

try:  # Python 3.11+ names the regex parser's modules this way; 3.10 has sre_parse/sre_constants
    from re import _constants as re_constants
    from re import _parser as re_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as re_constants  # type: ignore[no-redef]
    import sre_parse as re_parser  # type: ignore[no-redef]

_LAYERS_ITEM = re.compile(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?\Z")
MAX_LAYER_DIGITS = 18  # int64; an interval costs the same at any size
MAX_LAYERS_SPEC = 10_000
MAX_REGEX = 1_000
MAX_REPEATS = 4  # sequential .* multiply backtracking: 4 stay under a millisecond per site name
ROUTER_ENTRY = "Router"  # the class selector of every MoE router, whatever its class
ATTENTION_ENTRY = "Attention"  # the class selector of every attention module, whatever its class


class SiteRef(Protocol):
    """What a selector needs to know about a site (`qtransform.core.sites.Site` provides it)."""

    name: str
    cls_name: str
    kind: str  # "linear" | "conv1d" | "experts" | "norm" | "matmul"
    layer: int | None


def is_class_entry(text: str) -> bool:
    """True for a class selector: a bare identifier starting with an uppercase letter."""
    return text.isidentifier() and text[0].isupper()


@dataclass(frozen=True)
class LayerRanges:
    """A set of layer indices kept as sorted, merged closed intervals: `0-99999999999` costs two
    integers, not a hundred billion set entries. Supports `in`, `len` and iteration."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, layer: object) -> bool:
        if not isinstance(layer, int):
            return False
        i = bisect.bisect_right(self.ranges, (layer, math.inf)) - 1
        return i >= 0 and self.ranges[i][0] <= layer <= self.ranges[i][1]

    def __len__(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.ranges:
            yield from range(lo, hi + 1)


def parse_layers(spec: str) -> LayerRanges:
    """'10-17,20' -> the layers 10..17 and 20; raises ValueError naming the bad item."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("empty layer spec; write e.g. '10-17,20'")
    if len(spec) > MAX_LAYERS_SPEC:
        raise ValueError(f"layer spec of {len(spec)} characters; write ranges such as '10-17,20'")
    items: list[tuple[int, int]] = []
    for item in spec.split(","):
        match = _LAYERS_ITEM.match(item)
        if not match:
            raise ValueError(f"cannot read layer range {item.strip()[:40]!r}; write e.g. '10-17,20'")
        if any(len(g) > MAX_LAYER_DIGITS for g in match.groups() if g):
            raise ValueError(f"layer index in {item.strip()[:40]!r} is too large; models have at "
                             f"most {10**MAX_LAYER_DIGITS - 1} layers")
        lo = int(match.group(1))
        hi = int(match.group(2)) if match.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"layer range {item.strip()!r} runs backwards; write {hi}-{lo}")
        items.append((lo, hi))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(items):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return LayerRanges(tuple(merged))


def format_layers(layers: Iterable[int]) -> str:
    """{10, 11, 12, 20} -> '10-12,20' (the inverse of `parse_layers`)."""
    if isinstance(layers, LayerRanges):
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in layers.ranges)
    items = sorted(set(layers))
    runs: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        runs.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(runs)


def check_regex(pattern: str) -> None:
    """Refuse patterns that can backtrack catastrophically, before they run: a repeat whose body
    holds another repeat or an alternation (`(a+)+`, `(a|aa)*`), and backreferences. Site names
    are short, so every other pattern matches in time linear-ish in the name."""
    if len(pattern) > MAX_REGEX:
        raise ValueError(f"regular expression of {len(pattern)} characters; keep it under {MAX_REGEX}")
    try:
        parsed = re_parser.parse(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None
    repeats = _check_nodes(parsed, inside_repeat=False)
    if repeats > MAX_REPEATS:
        raise ValueError(f"{repeats} repeats (such as .* or +) in one pattern; each multiplies the "
                         f"matching time: use at most {MAX_REPEATS}")


_REPEATS = {re_constants.MAX_REPEAT, re_constants.MIN_REPEAT, re_constants.POSSESSIVE_REPEAT}


def _check_nodes(nodes: Iterable[tuple[Any, Any]], inside_repeat: bool) -> int:
    """Raise for a construct that backtracks exponentially; return the number of repeats."""
    count = 0
    for op, arg in nodes:
        if op in (re_constants.GROUPREF, re_constants.GROUPREF_EXISTS):
            raise ValueError("backreferences are not allowed in selectors; match the name directly")
        if op in _REPEATS:
            lo, hi, body = arg
            if inside_repeat and hi > 1:
                raise ValueError("nested quantifiers such as (a+)+ can take exponential time; "
                                 "write the pattern without a repeat inside a repeat")
            count += (hi > 1) + _check_nodes(body, inside_repeat or hi > 1)
        elif op == re_constants.BRANCH:
            if inside_repeat:
                raise ValueError("an alternation inside a repeat such as (a|aa)* can take "
                                 "exponential time; use a character class or drop the repeat")
            count += sum(_check_nodes(branch, inside_repeat) for branch in arg[1])
        elif op == re_constants.SUBPATTERN:
            count += _check_nodes(arg[-1], inside_repeat)
        elif op in (re_constants.ASSERT, re_constants.ASSERT_NOT):
            count += _check_nodes(arg[1], inside_repeat)
        elif op == re_constants.ATOMIC_GROUP:
            count += _check_nodes(arg, inside_repeat)
    return count


@dataclass(frozen=True)
class Entry:
    """One compiled target/ignore entry."""

    text: str
    kind: Literal["class", "regex", "glob"]
    regex: re.Pattern[str] | None = None

    def matches(self, site: SiteRef) -> bool:
        if getattr(site, "adapter", False) and not self.names_adapter:
            return False  # PEFT adapters stay in full precision unless an entry names them
        names = (site.name, alias) if (alias := getattr(site, "alias", None)) else (site.name,)
        if self.kind == "class":
            if getattr(site, "role", None) == ROUTER_ROLE:
                return self.text == ROUTER_ENTRY or (self.text == site.cls_name and self.text != "Linear")
            return (
                site.cls_name == self.text
                or (self.text.endswith("Norm") and site.cls_name.endswith(self.text))
                or (self.text == "Linear" and site.kind in LINEAR_KINDS)
                or (self.text == ATTENTION_ENTRY and getattr(site, "kind", None) == "attention")
            )
        if self.kind == "regex":
            assert self.regex is not None
            return any(self.regex.fullmatch(n) is not None for n in names)
        return any(fnmatch.fnmatchcase(n, self.text) or fnmatch.fnmatchcase(n, "*." + self.text)
                   for n in names)

    @property
    def names_adapter(self) -> bool:
        """Whether the entry names a PEFT adapter module (`lora_A`, `re:.*lora_B.*`, ...)."""
        return self.kind != "class" and any(key in self.text for key in ADAPTER_KEYS)


def compile_entry(text: str) -> Entry:
    """Compile one entry; raises ValueError for an empty entry or an invalid regex."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("empty selector entry")
    if text != text.strip():
        raise ValueError("selector entry has leading or trailing spaces")
    if text.startswith(REGEX_PREFIX):
        pattern = text[len(REGEX_PREFIX) :]
        if not pattern:
            raise ValueError("empty regular expression after 're:'")
        check_regex(pattern)
        try:
            return Entry(text, "regex", re.compile(pattern))
        except (re.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
    if is_class_entry(text):
        return Entry(text, "class")
    return Entry(text, "glob")


@dataclass(frozen=True)
class Selector:
    """Compiled targets/ignore/layers. `lenient_targets` marks a target list of alternatives
    (a section's default, such as ["RMSNorm", "LayerNorm"]): its entries count as unmatched only
    when none of them matches, since each model family has only one of them."""

    targets: tuple[Entry, ...]
    ignore: tuple[Entry, ...] = ()
    layers: LayerRanges | None = None
    layers_spec: str | None = None
    lenient_targets: bool = False

    @classmethod
    def compile(
        cls,
        targets: Sequence[str],
        ignore: Sequence[str] = (),
        layers: str | None = None,
        *,
        lenient_targets: bool = False,
    ) -> Selector:
        """Build a selector; raises ValueError for a bad entry or layer spec."""
        return _compile(tuple(targets), tuple(ignore), layers, lenient_targets)

    @classmethod
    def from_section(cls, section: Selected) -> Selector:
        """The selector of a policy section (anything with targets/ignore/layers fields)."""
        field = getattr(type(section), "model_fields", {}).get("targets")
        default = None
        if field is not None and not field.is_required():
            default = field.get_default(call_default_factory=True)
        return cls.compile(
            section.targets,
            section.ignore,
            section.layers,
            lenient_targets=default is not None and list(section.targets) == list(default),
        )

    def in_layers(self, site: SiteRef) -> bool:
        return self.layers is None or (site.layer is not None and site.layer in self.layers)

    def matches(self, site: SiteRef) -> bool:
        """True when the site is in `layers`, matches a target and no ignore entry."""
        if not self.in_layers(site):
            return False
        if any(e.matches(site) for e in self.ignore):
            return False
        return any(e.matches(site) for e in self.targets)

    def passed_routers(self, sites: Iterable[SiteRef]) -> list[str]:
        """The routers this selector would take through a class entry (``Linear``, their class)
        if routers were not reached only by name: what a plan lists as skipped, with why."""
        out = []
        for site in sites:
            if (getattr(site, "role", None) != ROUTER_ROLE or not self.in_layers(site)
                    or self.matches(site) or any(e.matches(site) for e in self.ignore)):
                continue
            if any(e.kind == "class" and (e.text == site.cls_name
                                          or (e.text == "Linear" and site.kind in LINEAR_KINDS))
                   for e in self.targets):
                out.append(site.name)
        return out

    def unmatched_entries(self, sites: Iterable[SiteRef]) -> list[str]:
        """Target and ignore entries that match none of `sites` inside `layers` (usually typos)."""
        pool = [s for s in sites if self.in_layers(s)]
        dead_targets = [e.text for e in self.targets if not any(e.matches(s) for s in pool)]
        if self.lenient_targets and len(dead_targets) < len(self.targets):
            dead_targets = []
        dead_ignore = [e.text for e in self.ignore if not any(e.matches(s) for s in pool)]
        return dead_targets + dead_ignore


@lru_cache(maxsize=512)
def _compile(
    targets: tuple[str, ...], ignore: tuple[str, ...], layers: str | None, lenient: bool
) -> Selector:
    return Selector(
        tuple(compile_entry(t) for t in targets),
        tuple(compile_entry(t) for t in ignore),
        parse_layers(layers) if layers is not None else None,
        layers,
        lenient,
    )




def resolve_quant_rules(
    rules: Sequence[Any], sites: Iterable[SiteRef], indices: Sequence[int] | None = None
) -> dict[tuple[str, str], tuple[int, Any]]:
    """(site name, tensor) -> (rule index, QuantRule) of the rule that applies.

    Rules are applied in order and a later matching rule overrides an earlier one for the same
    (site, tensor); a rule's other tensors keep what earlier rules chose. `indices`: each rule's
    index in its section, when `rules` is a part of it.
    """
    sites = list(sites)
    chosen: dict[tuple[str, str], tuple[int, Any]] = {}
    for index, rule in zip(indices if indices is not None else range(len(rules)), rules, strict=True):
        selector = Selector.from_section(rule)
        for site in sites:
            if selector.matches(site):
                for tensor in rule.tensors:
                    chosen[(site.name, tensor)] = (index, rule)
    return chosen
