"""Selector entries of other stacks, rewritten as qtransform entries that match the same modules.

A preset brings its stack's targets and ignore lists, and they must keep that stack's meaning:
llm-compressor (compressed-tensors `match_name`) applies ``re:X`` with ``re.match`` (anchored at
the start only: ``re:.*mlp.gate`` also matches ``mlp.gate_up_proj``) and compares a plain name with
the whole module name, while qtransform applies ``re:`` with ``re.fullmatch`` and treats a plain
name as a glob on trailing name parts (`qtransform.schemas.selectors`).
"""

from __future__ import annotations

import re

from ..selectors import REGEX_PREFIX, is_class_entry


def from_llm_compressor(entry: str) -> str:
    """The qtransform entry that matches what compressed-tensors matches with `entry`.

    ``re:X`` becomes ``re:(?:X).*`` (a full match of X followed by anything is exactly a match of
    X at the start); a class name (``Linear``) stays a class selector; any other string must equal
    the whole module name, so it becomes an escaped full-match regex (``lm_head`` ->
    ``re:lm_head``, which leaves ``model.lm_head`` alone as compressed-tensors does).
    """
    if entry.startswith(REGEX_PREFIX):
        return f"{REGEX_PREFIX}(?:{entry[len(REGEX_PREFIX):]}).*"
    if is_class_entry(entry):
        return entry
    return REGEX_PREFIX + re.escape(entry)


MODELOPT_QUANTIZERS = (".weight_quantizer", ".input_quantizer")  # what ModelOpt's patterns are matched on


def from_modelopt(patterns: list[str]) -> str:
    """One `re:` entry matching the modules whose quantizers ModelOpt's fnmatch `patterns` disable.

    ModelOpt matches its wildcards (``*lm_head*``, ``*mlp.gate.*``, ``output.*``) with
    `fnmatch` against QUANTIZER names, ``<module>.weight_quantizer``: so ``*mlp.gate.*`` takes
    the module ``mlp.gate`` (the ``.`` is the quantizer's) but never ``mlp.gate_up_proj``. Each
    pattern must be ``*X*`` or ``X*`` with a literal X; a module matches when ``<module>`` plus
    either quantizer suffix does: X occurs in the name (``*X*``) or starts it (``X*``), or the
    name ends with a head of X (``*X*``) or is one (``X*``) whose tail starts the suffix. The
    entries are folded into one regex, because a preset's ignore entry that matches no module of
    a model is an error and ModelOpt's list names modules most models lack.
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
    return REGEX_PREFIX + "|".join(parts + whole)
