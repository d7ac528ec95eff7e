"""The policy's sections, one module each; the `Policy` root is assembled from what registers here.

A section module defines its Pydantic spec and registers it with `register_section`, giving the
key it has in the policy file, its default, and how it describes itself in words (`policy
explain`, `policy validate`). Every module of this package is imported below, so a new section is
one new file here (plus the pass that reads it in `passes/`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError


@dataclass(frozen=True)
class Section:
    """One top-level key of a policy file."""

    name: str
    annotation: Any  # the field type on Policy, e.g. `HWErrorSpec | None`
    default: Any  # None for an optional section, a factory's value for a list section
    describe: Callable[[Any], list[str]]  # paragraphs for `policy explain`
    summary: Callable[[Any], str]  # a few words for `policy validate`
    order: int  # position in the file and in explanations (also the usual pipeline order)
    description: str = ""
    example: Any = None  # a minimal valid value: docs, and the conformance test over every pass

    def validate(self, value: object) -> Any:
        """`value` parsed as this section's value (pydantic errors for a bad one)."""
        return TypeAdapter(self.annotation).validate_python(value)


SECTIONS: dict[str, Section] = {}


def register_section(section: Section) -> Section:
    """Add a section to the policy; its name must be new and its example valid (checked at
    import, so a section cannot ship without one)."""
    if section.name in SECTIONS or section.name == "version":
        raise ValueError(f"policy section {section.name!r} is registered already")
    if section.example is None:
        raise ValueError(f"policy section {section.name!r} needs an example (Section(..., example=...)): "
                         "a minimal valid value")
    try:
        section.validate(section.example)
    except ValidationError as exc:
        raise ValueError(f"policy section {section.name!r}: its example is not valid: {exc}") from None
    SECTIONS[section.name] = section
    return section


def ordered() -> list[Section]:
    return sorted(SECTIONS.values(), key=lambda s: (s.order, s.name))


for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
