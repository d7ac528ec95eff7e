"""Reading policies from files, JSON text, dicts or Policy objects, with readable errors."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from qtransform.core.io import read_input_text
from qtransform.errors import UserError

from .errors import PolicyError, Problem, from_validation_error
from .policy import Policy

# what every function that takes a policy accepts: load_policy reads each of them
PolicyLike = Policy | Mapping[str, Any] | str | os.PathLike
LEGACY_MARKERS = ("base_sigma", "layer_multipliers", "sigma_start")
MAX_INT_DIGITS = 19
MAX_NUMBER_CHARS = 400
MAX_POLICY_BYTES = 16 * 2**20


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a repeated key would silently drop the first value."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PolicyError([Problem(f"key {key!r}", "appears twice in one JSON object")])
        out[key] = value
    return out


def _parse_int(text: str) -> int:
    """JSON integers up to 19 digits (int64): longer ones are typos or attacks, and Python's int
    parsing is quadratic in the digits."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise PolicyError([Problem(f"number {text[:12]}...", f"an integer of {len(text)} digits is "
                                   f"out of range; integers have at most {MAX_INT_DIGITS} digits")])
    return int(text)


def _parse_float(text: str) -> float:
    """Finite JSON numbers only: 1e999 would silently become infinity."""
    if len(text) > MAX_NUMBER_CHARS or not math.isfinite(value := float(text)):
        raise PolicyError([Problem(f"number {text[:12]}", "out of the range of a 64-bit float")])
    return value


def _reject_constant(text: str) -> float:
    raise PolicyError([Problem(text, "NaN and Infinity are not JSON numbers; write a finite number")])


def parse_json(text: str, source: str | None = None) -> Any:
    """json.loads with errors that give line and column (the PolicyError names `source`), and
    with repeated keys rejected."""
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates, parse_int=_parse_int,
                          parse_float=_parse_float, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        problem = Problem(f"line {exc.lineno}, column {exc.colno}", f"invalid JSON: {exc.msg}")
    except RecursionError:
        problem = Problem("(json)", "invalid JSON: nested too deeply")
    except PolicyError as exc:
        raise PolicyError(exc.problems, source) from None
    raise PolicyError([problem], source)


def read_json(source: Mapping[str, Any] | str | os.PathLike) -> tuple[Any, str | None]:
    """(data, source name) from a dict, a path or JSON text.

    A str is read as a path when it names an existing file and as JSON text otherwise.
    """
    if isinstance(source, Mapping):
        return dict(source), None
    if isinstance(source, str) and not _is_file(source):
        if source.lstrip().startswith(("{", "[")) or "\n" in source or len(source) > 255:
            return parse_json(source), None
        raise PolicyError([Problem(source, "no such file (and not JSON text)")])
    if not isinstance(source, (str, os.PathLike)):
        raise PolicyError(
            [
                Problem(
                    "(policy)",
                    "expected a Policy, a dict, JSON text or a path",
                    type(source).__name__,
                )
            ]
        )
    path = Path(source)
    if not (path.exists() or path.is_symlink()):
        raise PolicyError([Problem(str(path), "no such file")])
    try:
        text = read_input_text(path, "policy file", limit=MAX_POLICY_BYTES)
    except UserError as exc:
        raise PolicyError([Problem(str(path), str(exc).removeprefix(f"{path}: "))]) from None
    return parse_json(text, str(path)), str(path)


def _is_file(text: str) -> bool:
    try:
        path = Path(text)
        return path.exists() or path.is_symlink()  # a FIFO or a dangling link: read_json says so
    except (OSError, ValueError):  # name too long, embedded NUL
        return False


def is_legacy_srdd(data: object) -> bool:
    """True for a pre-policy SRDD sigma config such as {"base_sigma": 0.01, "layer_multipliers": ...}."""
    return (
        isinstance(data, dict) and "version" not in data and any(k in data for k in LEGACY_MARKERS)
    )


def validate_policy(data: object, source: str | None = None) -> Policy:
    """Validate parsed JSON as a Policy, raising PolicyError with one line per problem."""
    if is_legacy_srdd(data):
        raise PolicyError(
            [
                Problem(
                    "(policy)",
                    "this is a legacy SRDD sigma config (base_sigma / layer_multipliers), not a policy; "
                    "convert it with qtransform.schemas.from_legacy_srdd(cfg, total_steps=...) or "
                    "`qtransform policy validate FILE --legacy --total-steps N --json`",
                )
            ],
            source,
        )
    if not isinstance(data, dict):
        raise PolicyError([Problem("(policy)", "expected a JSON object", data)], source)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, Policy, source) from None


def load_policy(source: PolicyLike) -> Policy:
    """A Policy from a Policy (returned as is), a dict, a path, or JSON text."""
    if isinstance(source, Policy):
        return source
    data, name = read_json(source)
    return validate_policy(data, name)


def dump_policy(policy: Policy) -> dict[str, Any]:
    """The policy as JSON-ready data with every default spelled out; load_policy inverts it."""
    return policy.model_dump(mode="json")
