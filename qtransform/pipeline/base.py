"""The pass contract: what a pass is, what it returns, and the registry of passes.

A leaf of the pipeline layer (torch.fx's `pass_base` plays the same role): it imports no pass, so
passes, the manager and `transform()` all import it at the top. A pass reads one section of the
policy, typed: `section` names it and `select` receives that section's spec object (or is not
called when the policy has no such section).

`select` hands `build` one typed payload per action (torchao's handler-receives-its-config
shape): a pass is `Pass[SpecT, PayloadT]`, its actions are `Action[PayloadT]`, and the manager
checks that every action a pass selects carries a `PayloadT` (the type argument, read when the
pass registers), so a pass cannot hand itself a dict of loose keys.

The smallest pass, in full (see docs/architecture.md for the files a new pass touches)::

    @register_pass
    class ClampPass(Pass[ClampSpec, ClampSpec]):
        name = tag = section = "clamp"

        def select(self, program, spec):
            return [Action(s, spec.point, "clamp", spec)
                    for s in select_sites(program, spec, "clamp", kinds=LINEAR_KINDS)]

        def build(self, program, action):
            return Clamp(action.payload.limit)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar, get_args, get_origin

from torch import nn

from qtransform.core.program import Program
from qtransform.core.sites import Site
from qtransform.schemas.sections import SECTIONS

SpecT = TypeVar("SpecT")
PayloadT = TypeVar("PayloadT")


@dataclass
class Action(Generic[PayloadT]):
    """One thing a pass will do: insert at `point` of `site`, selected by `rule`, with the
    pass's typed `payload` (what `build` and `describe` need, decided in `select`)."""

    site: Site
    point: str
    rule: str  # which policy entry selected it, e.g. "quantize[0] 'w4'"
    payload: PayloadT = None  # type: ignore[assignment]  # a pass without data has none
    extra: tuple[str, ...] = ()  # other values the inserted module takes (see GraphSite.insert)


class Pass(ABC, Generic[SpecT, PayloadT]):
    """A transformation: selects actions from its policy section, builds the module for each."""

    name: ClassVar[str]
    tag: ClassVar[str]  # short label used in inserted module names ("fake_quant", "tap", ...)
    section: ClassVar[str]  # the policy section this pass reads ("quantize", "noise", ...)
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    modes: ClassVar[tuple[str, ...]] = ("module", "graph")  # the capture modes it works in
    payload_type: ClassVar[type | None] = None  # PayloadT, set by register_pass

    @abstractmethod
    def select(self, program: Program, spec: SpecT) -> list[Action[PayloadT]]:
        """The actions the section asks for; an entry that selects nothing raises UserError."""

    @abstractmethod
    def build(self, program: Program, action: Action[PayloadT]) -> nn.Module:
        """The module to insert for one action."""

    def finish(self, program: Program, actions: list[Action[PayloadT]]) -> None:
        """After this pass's insertions, before the lint: edits that span several insertions
        of a site (the fake-quant pass's Linear with its own backward). Nothing by default."""

    def describe(self, action: Action[PayloadT]) -> str:
        """One line for plans: what the inserted module does ("mxfp4 block=32")."""
        return ""

    def notes(self, actions: list[Action[PayloadT]]) -> list[str]:
        """Lines for the end of a plan about all of this pass's actions together (extremes)."""
        return []

    @classmethod
    def label(cls, site: str, point: str) -> str:
        """The name of this pass's node at a site's point in exported graphs (and the key of its
        random stream): `<site>/<point>_<tag>`. The export audit asks the pass, never rebuilds it."""
        return f"{site}/{point}_{cls.tag}"


def payload_type(cls: type[Pass]) -> type | None:
    """The `PayloadT` a pass class was declared with (`Pass[Spec, Payload]`), if any."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if get_origin(base) is Pass:
                args = get_args(base)
                if len(args) == 2 and isinstance(args[1], type):
                    return args[1]
    return None


_REGISTRY: dict[str, type[Pass]] = {}


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Add a pass class to the standard pipeline (in registration order, then by dependencies)."""
    if not cls.name.isidentifier() or not cls.name.islower():
        raise ValueError(f"pass name {cls.name!r} must be a lower-case identifier")
    if _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"a pass named {cls.name!r} is registered already ({_REGISTRY[cls.name]})")
    if cls.section not in SECTIONS:
        raise ValueError(f"pass {cls.name!r} reads the policy section {cls.section!r}, which no module of "
                         f"qtransform/schemas/sections registers (sections: {', '.join(SECTIONS)})")
    cls.payload_type = payload_type(cls)
    if cls.payload_type is None:
        raise ValueError(f"pass {cls.name!r} must declare its payload type: class "
                         f"{cls.__name__}(Pass[<SectionSpec>, <Payload>])")
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> list[Pass]:
    """One instance of every registered pass: the standard pipeline."""
    if not _REGISTRY:
        raise RuntimeError("no pass is registered: import qtransform (which imports qtransform.passes)")
    return [cls() for cls in _REGISTRY.values()]
