"""The pass contract: what a pass is, what it returns, and the registry of passes.

A leaf of the pipeline layer (torch.fx's `pass_base` plays the same role): it imports no pass, so
passes, the manager and `transform()` all import it at the top. A pass reads one section of the
policy, typed: `section` names it and `select` receives that section's spec object (or is not
called when the policy has no such section).

The smallest pass, in full (see docs/architecture.md for the files a new pass touches)::

    @register_pass
    class ClampPass(Pass[ClampSpec]):
        name = tag = section = "clamp"

        def select(self, program, spec):
            return [Action(s, spec.point, "clamp", {"limit": spec.limit})
                    for s in select_sites(program, spec, "clamp", kinds=LINEAR_KINDS)]

        def build(self, program, action):
            return OutputClamp(action.params["limit"])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from torch import nn

from qtransform.core.program import Program
from qtransform.core.sites import Site

SpecT = TypeVar("SpecT")


@dataclass
class Action:
    """One thing a pass will do: insert at `point` of `site`, selected by `rule`."""

    site: Site
    point: str
    rule: str  # which policy entry selected it, e.g. "quantize[0] 'w4'"
    params: dict[str, Any] = field(default_factory=dict)
    extra: tuple[str, ...] = ()  # other values the inserted module takes (see GraphSite.insert)


class Pass(ABC, Generic[SpecT]):
    """A transformation: selects actions from its policy section, builds the module for each."""

    name: ClassVar[str]
    tag: ClassVar[str]  # short label used in inserted module names ("fake_quant", "tap", ...)
    section: ClassVar[str]  # the policy section this pass reads ("quantize", "noise", ...)
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def select(self, program: Program, spec: SpecT) -> list[Action]:
        """The actions the section asks for; an entry that selects nothing raises UserError."""

    @abstractmethod
    def build(self, program: Program, action: Action) -> nn.Module:
        """The module to insert for one action."""

    def describe(self, action: Action) -> str:
        """One line for plans: what the inserted module does ("mxfp4 block=32")."""
        return ""


_REGISTRY: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Add a pass class to the standard pipeline (in registration order, then by dependencies)."""
    if not cls.name.isidentifier() or not cls.name.islower():
        raise ValueError(f"pass name {cls.name!r} must be a lower-case identifier")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"a pass named {cls.name!r} is registered already ({_REGISTRY[cls.name]})")
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> list[Pass]:
    """One instance of every registered pass: the standard pipeline."""
    if not _REGISTRY:
        raise RuntimeError("no pass is registered: import qtransform (which imports qtransform.passes)")
    return [cls() for cls in _REGISTRY.values()]
