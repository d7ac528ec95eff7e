"""Policy errors a person can act on.

Every problem is reported as ``<json path>: <problem>; got <value>; allowed: <...> (did you mean
'X'?)``. Pydantic's own messages name Python types and internal union tags; this module turns a
`ValidationError` into that form, walking the policy models to list allowed field names and enum
values. Validators in the models report cross-field problems through `problems_error`, which
carries a path relative to the model being validated.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticCustomError

from qtransform.errors import UserError
from qtransform.formats.registry import suggest

Loc = tuple[Any, ...]
_NOTHING = object()
_MAX_SHOWN = 60


def show(value: object) -> str:
    """A short, JSON-flavoured rendering of a user value ('abc', 3, true, null, [...])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        text = repr(value)
    else:
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def format_path(loc: Loc) -> str:
    """('quantize', 0, 'format') -> 'quantize[0].format'; keys that are not identifiers get ["k"]."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier():
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(str(part))}]"
    return out or "(policy)"


@dataclass(frozen=True)
class Problem:
    """One problem at one JSON path."""

    path: str
    problem: str
    got: Any = _NOTHING
    allowed: Sequence[str] | None = None
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.path}: {self.problem}"
        if self.got is not _NOTHING:
            text += f"; got {show(self.got)}"
        if self.allowed:
            text += f"; allowed: {', '.join(map(str, self.allowed))}"
        return text + self.hint

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "message": str(self)}


class PolicyError(UserError):
    """An invalid policy: the message lists every problem, one per line, each with its path."""

    def __init__(self, problems: Sequence[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"invalid policy{f' {source}' if source else ''}"
        if len(self.problems) == 1:
            super().__init__(f"{head}: {self.problems[0]}")
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            super().__init__(f"{head} ({len(self.problems)} problems):\n{lines}")


@dataclass(frozen=True)
class Issue:
    """A problem found by a model validator, at `rel` below the validated model."""

    rel: Loc
    problem: str
    got: Any = _NOTHING
    allowed: Sequence[str] | None = None
    hint: str = ""


def problems_error(issues: Sequence[Issue]) -> PydanticCustomError:
    """A pydantic error carrying several located problems (raised from validators)."""
    summary = "; ".join(f"{format_path(i.rel)}: {i.problem}" for i in issues)
    return PydanticCustomError("policy", "{summary}", {"summary": summary, "issues": tuple(issues)})


# -- translating pydantic errors -------------------------------------------------------------

_TYPE_WORDS = {
    "int": "expected an integer",
    "float": "expected a number",
    "bool": "expected true or false",
    "string": "expected a string",
    "list": "expected a list",
    "tuple": "expected a list",
    "dict": "expected an object",
    "model": "expected an object",
}


def _unwrap(ann: object) -> Any:
    """Strip Annotated[...] and Optional[...] down to the type the value must have."""
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (Union, types.UnionType):
            rest = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(rest) != 1:
                return ann
            ann = rest[0]
        else:
            return ann


def _annotation_at(root: type[BaseModel], loc: Loc) -> Any:
    """The (unwrapped) annotation of the value at `loc`, or None where the walk loses track."""
    ann: Any = root
    for part in loc:
        ann = _unwrap(ann)
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(part, str):
            field = ann.model_fields.get(part)
            if field is None:
                return None
            ann = field.annotation
        elif origin in (list, tuple) and isinstance(part, int):
            ann = typing.get_args(ann)[0]
        elif origin is dict:
            ann = typing.get_args(ann)[1]
        else:
            return None
    return _unwrap(ann)


def _literal_values(ann: object) -> list[str] | None:
    if typing.get_origin(ann) is Literal:
        return [str(v) for v in typing.get_args(ann)]
    return None


def _translate(root: type[BaseModel], err: ErrorDetails) -> list[Problem]:
    loc: Loc = tuple(err["loc"])
    kind: str = err["type"]
    ctx = err.get("ctx") or {}
    got = err.get("input", _NOTHING)
    if kind == "policy":
        return [
            Problem(format_path(loc + i.rel), i.problem, i.got, i.allowed, i.hint)
            for i in ctx["issues"]
        ]
    path = format_path(loc)
    if kind == "extra_forbidden":
        parent = _annotation_at(root, loc[:-1])
        fields = (
            list(parent.model_fields)
            if isinstance(parent, type) and issubclass(parent, BaseModel)
            else []
        )
        return [Problem(path, "unknown field", allowed=fields, hint=suggest(str(loc[-1]), fields))]
    if kind == "missing":
        return [Problem(path, "required field is missing")]
    if kind == "literal_error":
        allowed = _literal_values(_annotation_at(root, loc)) or []
        return [Problem(path, "unknown value", got, allowed, suggest(str(got), allowed))]
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {
            "greater_than": ">",
            "greater_than_equal": ">=",
            "less_than": "<",
            "less_than_equal": "<=",
        }[kind]
        bound = next(iter(ctx.values()), "?")
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        return [Problem(path, f"must be {op} {bound}", got)]
    if kind == "finite_number":
        return [Problem(path, "must be a finite number", got)]
    if kind == "too_short":
        return [Problem(path, f"needs at least {ctx.get('min_length', 1)} item(s)", got)]
    if kind == "too_long":
        return [Problem(path, f"allows at most {ctx.get('max_length')} item(s)", got)]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return [Problem(path, "expected an object", got)]
    base = kind.split("_")[0]
    if base in _TYPE_WORDS:
        return [Problem(path, _TYPE_WORDS[base], got)]
    message = str(err.get("msg", kind)).removeprefix("Value error, ")
    return [Problem(path, message, got)]


def from_validation_error(
    exc: ValidationError, root: type[BaseModel], source: str | None = None
) -> PolicyError:
    """Turn pydantic's errors into one PolicyError, one located problem per error."""
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        for p in _translate(root, err):
            if p not in problems:
                problems.append(p)
    return PolicyError(problems, source)
