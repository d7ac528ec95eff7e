"""The policy root: `version` plus one field per registered section (`schemas/sections/`).

Problems are raised as pydantic errors; `qtransform.schemas.load_policy` turns them into a
readable `PolicyError`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model, field_validator

from .base import StrictModel
from .errors import Issue, problems_error
from .sections import SECTIONS, ordered


class PolicyRoot(StrictModel):
    """What every policy has besides its sections."""

    version: Literal[1] = Field(1, description="the policy file format; 1")

    @field_validator("version", mode="before")
    @classmethod
    def _version_one(cls, value: Any) -> Any:
        """Only exactly 1 (not true, not 1.0): later versions will be migrated, not guessed."""
        if type(value) is not int or value != 1:
            raise problems_error([Issue((), "unsupported policy version", value, ["1"])])
        return value

    def section(self, name: str) -> Any:
        """The section a pass reads (its `Pass.section`); None or [] when the policy has none."""
        if name not in SECTIONS:
            raise KeyError(f"the policy has no section {name!r}; sections: {', '.join(SECTIONS)}")
        return getattr(self, name)

    def to_json(self, indent: int | None = 2) -> str:
        """The policy as JSON text; `load_policy` reads it back to an equal Policy."""
        return self.model_dump_json(indent=indent)


def _field(section: Any) -> tuple[Any, Any]:
    """The root's field for a section; its example travels into the JSON Schema (`examples`)."""
    text = {"description": section.description or None, "examples": [section.example]}
    if isinstance(section.default, list):
        return section.annotation, Field(default_factory=list, **text)
    return section.annotation, Field(section.default, **text)


Policy = create_model(  # type: ignore[call-overload]
    "Policy",
    __base__=PolicyRoot,
    __doc__="The root of a policy file.",
    __module__=__name__,
    **{s.name: _field(s) for s in ordered()},
)
