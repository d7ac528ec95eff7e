"""Building blocks of every policy model: strict scalar types and the selector fields.

Every model forbids unknown fields (a misspelt key must not silently fall back to a default) and
uses strict scalars (``"32"`` or ``true`` is not a block size).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictStr, field_validator

from .errors import Issue, problems_error
from .selectors import Selector, compile_entry, parse_layers

Int = Annotated[int, Strict()]
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
Float = Annotated[float, Strict(), AllowInfNan(False)]
PosFloat = Annotated[float, Strict(), AllowInfNan(False), Field(gt=0)]
NonNegFloat = Annotated[float, Strict(), AllowInfNan(False), Field(ge=0)]
Fraction = Annotated[float, Strict(), AllowInfNan(False), Field(ge=0, le=1)]
Entries = list[StrictStr]

Tensor = Literal["weight", "input", "output"]
AttentionTensor = Literal["query", "key", "value", "probs"]  # an attention site's points
QuantTensor = Literal["weight", "input", "output", "query", "key", "value", "probs"]
ATTENTION_TENSORS: tuple[str, ...] = AttentionTensor.__args__  # type: ignore[attr-defined]
Phase = Literal["train", "eval", "both", "rollout"]
TENSORS: tuple[str, ...] = Tensor.__args__  # type: ignore[attr-defined]


def unique(values: list[Any]) -> list[Any]:
    """Reject repeated list items (a repeated tensor or metric is always a slip)."""
    issues = [Issue((i,), "duplicate item", v) for i, v in enumerate(values) if v in values[:i]]
    if issues:
        raise problems_error(issues)
    return values


class StrictModel(BaseModel):
    """Base of every policy model: unknown fields are errors and a parsed policy is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def compiled_entries(entries: list[str]) -> list[str]:
    """`entries` when each is a valid selector entry, else the problems of those that are not."""
    issues = []
    for i, text in enumerate(entries):
        try:
            compile_entry(text)
        except ValueError as exc:
            issues.append(Issue((i,), str(exc), text))
    if issues:
        raise problems_error(issues)
    return entries


class Selected(StrictModel):
    """Selector fields shared by every section; see `qtransform.schemas.selectors`."""

    targets: Entries = Field(
        default_factory=lambda: ["Linear"],
        min_length=1,
        description="class names (Linear, RMSNorm), globs on module names, or 're:' regexes",
    )
    ignore: Entries = Field(default_factory=list, description="entries excluded even if targeted")
    layers: StrictStr | None = Field(None, description="layer indices, e.g. '10-17,20'")

    @field_validator("targets", "ignore")
    @classmethod
    def _entries_compile(cls, entries: list[str]) -> list[str]:
        return compiled_entries(entries)

    @field_validator("layers")
    @classmethod
    def _layers_parse(cls, spec: str | None) -> str | None:
        if spec is not None:
            try:
                parse_layers(spec)
            except ValueError as exc:
                raise problems_error([Issue((), str(exc), spec)]) from None
        return spec

    def selector(self) -> Selector:
        """The compiled selector of this section."""
        return Selector.from_section(self)
