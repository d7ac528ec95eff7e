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
