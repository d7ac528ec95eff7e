"""The policy root: `version` plus one field per registered section (`schemas/sections/`).

Problems are raised as pydantic errors; `qtransform.schemas.load_policy` turns them into a
readable `PolicyError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    create_model,
    field_validator,
    model_validator,
)

from . import presets
from .base import StrictModel
from .errors import Issue, problems_error
from .sections import SECTIONS, Section, ordered


class PolicyRoot(StrictModel):
    """What every policy has besides its sections."""

    version: Literal[1] = Field(1, description="the policy file format; 1")
    preset: StrictStr | list[StrictStr] | None = Field(
        None, description="a stack's recipe this policy expands from, e.g. 'llm-compressor/NVFP4' "
        "(`qtransform policy presets` lists them), or a list of them merged in order (a weight "
        "preset and a KV-cache one: later entries win); the policy's own fields are merged over it")
    preset_options: dict[str, StrictBool | StrictInt | StrictStr | None] | None = Field(
        None, description="switches of the preset, e.g. {\"disable_rht\": true} for "
        "'transformer-engine/NVFP4BlockScaling' (`qtransform policy presets` lists each preset's)")

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: object) -> Any:
        """A named preset becomes its explicit rules and sections, with the user's fields merged
        over them (`qtransform.schemas.presets`), before anything else is validated."""
        if not isinstance(data, Mapping):
            return data
        if data.get("preset") is None:
            if data.get("preset_options") is not None:
                raise problems_error([Issue(("preset_options",), "only used with a preset",
                                            data["preset_options"], hint=' (add "preset": "<stack>/<scheme>")')])
            return data
        names = data["preset"]
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise problems_error([Issue(("preset",), f"expected {presets.NAME_HELP}, or a list of them",
                                        data["preset"])])
        chosen = []
        for i, name in enumerate(names):
            preset = presets.find_preset(name)
            if preset is None:
                where = ("preset",) if isinstance(data["preset"], str) else ("preset", i)
                raise problems_error([Issue(where, "unknown preset", name, presets.preset_names(),
                                            presets.suggestion(name))])
            chosen.append(preset)
        return presets.expand(data, chosen)

    @field_validator("version", mode="before")
    @classmethod
    def _version_one(cls, value: object) -> Any:
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


def _field(section: Section) -> tuple[Any, Any]:
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
