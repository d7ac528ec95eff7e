"""How each checkpoint format names the modules it quantizes or ignores, in one place: the
matcher the reader uses on a model's modules, and the qtransform selector entry that selects the
same modules (what the presets and the opened checkpoint's policy write).

- compressed-tensors (`match_name`, `targets` / `ignore`): ``re:X`` is ``re.match`` (anchored at
  the start only: ``re:.*mlp.gate`` also matches ``mlp.gate_up_proj``), a class name matches the
  module's class, any other string equals the whole module name. qtransform applies ``re:`` with
  ``re.fullmatch`` and treats a plain name as a glob on trailing name parts
  (`qtransform.schemas.selectors`), hence `ct_entry`.
- ModelOpt (`exclude_modules`, its disabled-quantizer wildcards): `fnmatch` against the names of
  the module's QUANTIZERS, ``<module>.weight_quantizer``; see `modelopt_entry`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

REGEX = "re:"  # the regex prefix both compressed-tensors and qtransform selectors use
MODELOPT_QUANTIZERS = (".weight_quantizer", ".input_quantizer")  # what ModelOpt's patterns match


def is_class_name(entry: str) -> bool:
    """A class target (``Linear``): a bare identifier starting with an uppercase letter, as the
    selectors read it."""
    return entry.isidentifier() and entry[0].isupper()


def ct_matches(entry: str, name: str, class_name: str | None = None) -> bool:
    """Whether compressed-tensors' target or ignore `entry` matches the module `name` (of class
    `class_name`, when known: a class entry matches nothing without it)."""
    if entry.startswith(REGEX):
        return re.match(entry[len(REGEX):], name) is not None
    return entry == name or (class_name is not None and entry == class_name)


def ct_entry(entry: str) -> str:
    """The qtransform selector entry that matches what compressed-tensors matches with `entry`:
    ``re:X`` becomes ``re:(?:X).*`` (a full match of X then anything is a match of X at the
    start); a class name stays a class selector; a module name becomes an escaped full-match regex
    (``lm_head`` -> ``re:lm_head``, which leaves ``model.lm_head`` alone, as compressed-tensors
    does)."""
    if entry.startswith(REGEX):
        return f"{REGEX}(?:{entry[len(REGEX):]}).*"
    if is_class_name(entry):
        return entry
    return REGEX + re.escape(entry)


def ct_ignored_entries(ignore: Iterable[str], names: list[str]) -> list[str]:
    """A compressed-tensors ignore list as qtransform entries, keeping those that name a module
    of the model (a policy entry that matches nothing is an error; producers list more)."""
    return [ct_entry(e) for e in ignore if any(ct_matches(e, n) for n in names)]


def modelopt_ignored_entries(patterns: Iterable[str], names: list[str]) -> list[str]:
    """ModelOpt's `exclude_modules` (fnmatch wildcards on module names, as its export writes
    them) as one qtransform entry, keeping the patterns that match a module of the model."""
    found = [fnmatch.translate(p) for p in patterns if any(fnmatch.fnmatchcase(n, p) for n in names)]
    return [f"{REGEX}(?:{'|'.join(found)})"] if found else []


def modelopt_entry(patterns: list[str]) -> str:
    """One ``re:`` entry matching the modules whose quantizers ModelOpt's fnmatch `patterns`
    disable.

    Each pattern must be ``*X*`` or ``X*`` with a literal X; a module matches when ``<module>``
    plus either quantizer suffix does: X occurs in the name (``*X*``) or starts it (``X*``), or
    the name ends with a head of X (``*X*``) or is one (``X*``) whose tail starts the suffix. So
    ``*mlp.gate.*`` takes ``mlp.gate`` (the ``.`` is the quantizer's) but never
    ``mlp.gate_up_proj``. The entries are folded into one regex, because a preset's ignore entry
    that matches no module of a model is an error and ModelOpt's list names modules most models
    lack.
    """
    inside, starts, ends, whole = [], [], [], []  # see the docstring, in that order
    for pattern in patterns:
        core = pattern.strip("*")
        if (not pattern.endswith("*") or not core or any(c in core for c in "*?[]")
                or any(core in suffix for suffix in MODELOPT_QUANTIZERS)):
            raise ValueError(f"ModelOpt pattern {pattern!r}: only '*X*' and 'X*' with a literal X "
                             "that names modules are translated")
        heads = sorted({re.escape(core[:k]) for k in range(1, len(core))
                        if any(suffix.startswith(core[k:]) for suffix in MODELOPT_QUANTIZERS)})
        if pattern.startswith("*"):
            inside.append(re.escape(core))
            ends += heads
        else:
            starts.append(re.escape(core))
            whole += heads
    found = ([f".*(?:{'|'.join(inside)})"] if inside else []) + starts
    parts = [f"(?:{'|'.join(found)}).*"] if found else []
    parts += [f".*(?:{'|'.join(ends)})"] if ends else []
    return REGEX + "|".join(parts + whole)
