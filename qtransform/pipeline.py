"""Passes, the pass manager, selection reports, and `transform()`.

A pass declares what it requires and provides; the manager orders passes with a networkx
topological sort (missing providers and cycles are errors naming the passes), asks each pass
which (site, point) actions the policy selects, builds the module for each action, inserts it
through the site-level helpers, lints every touched graph and logs every insertion.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import networkx as nx
from torch import nn

from qtransform.capture import capture
from qtransform.program import Program
from qtransform.sites import Site


@dataclass
class Action:
    """One thing a pass will do: insert at `point` of `site`, selected by `rule`."""

    site: Site
    point: str
    rule: str  # which policy entry selected it, e.g. "quantize[0] 'w4'"
    params: dict[str, Any] = field(default_factory=dict)
    extra: tuple[str, ...] = ()  # other values the inserted module takes (see GraphSite.insert)


@dataclass(frozen=True)
class PlanRow:
    site: str
    pass_name: str
    point: str
    rule: str
    detail: str


@dataclass
class Plan:
    """Every site with the rules that selected it (or none)."""

    sites: list[Site]
    rows: list[PlanRow]

    def for_site(self, name: str) -> list[PlanRow]:
        return [r for r in self.rows if r.site == name]

    def to_dict(self) -> dict:
        return {
            "sites": [
                {**s.to_dict(), "actions": [r.__dict__ for r in self.for_site(s.name)]} for s in self.sites
            ]
        }

    def to_text(self) -> str:
        """A table: one line per site, its layer, role and what each pass does there."""
        width = max((len(s.name) for s in self.sites), default=4)
        lines = [f"{'site':<{width}}  {'kind':<6} {'layer':>5}  {'role':<7} actions"]
        for s in self.sites:
            acts = "; ".join(f"{r.pass_name}:{r.point} {r.detail} [{r.rule}]" for r in self.for_site(s.name))
            layer = "-" if s.layer is None else str(s.layer)
            lines.append(f"{s.name:<{width}}  {s.kind:<6} {layer:>5}  {s.role:<7} {acts or '(none)'}")
        selected = sum(1 for s in self.sites if self.for_site(s.name))
        lines.append(f"{selected} of {len(self.sites)} sites selected, {len(self.rows)} insertions")
        return "\n".join(lines)


class Pass(ABC):
    """A transformation: selects actions from the policy, builds the module for each."""

    name: ClassVar[str]
    tag: ClassVar[str]  # short label used in inserted module names ("fake_quant", "tap", ...)
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def select(self, program: Program, policy: Any) -> list[Action]:
        """The actions the policy asks for; an entry that selects nothing raises UserError."""

    @abstractmethod
    def build(self, program: Program, action: Action) -> nn.Module:
        """The module to insert for one action."""

    def describe(self, action: Action) -> str:
        return ""


class PassManager:
    """Runs passes in dependency order and logs every insertion in the Program."""

    def __init__(self, passes: Sequence[Pass]):
        self.passes = list(passes)
        self.order = self._order()

    def _order(self) -> list[Pass]:
        dag = nx.DiGraph()
        index = {p.name: i for i, p in enumerate(self.passes)}
        by_name = {p.name: p for p in self.passes}
        dag.add_nodes_from(index)
        for p in self.passes:
            for req in p.requires:
                providers = [q.name for q in self.passes if req in q.provides]
                if not providers:
                    raise ValueError(f"pass {p.name!r} requires {req!r}, which no pass provides")
                dag.add_edges_from((q, p.name) for q in providers)
        try:
            names = list(nx.lexicographical_topological_sort(dag, key=index.__getitem__))
        except nx.NetworkXUnfeasible:
            cycle = " -> ".join(edge[0] for edge in nx.find_cycle(dag))
            raise ValueError(f"passes form a dependency cycle: {cycle}") from None
        return [by_name[n] for n in names]

    def select(self, program: Program, policy: Any) -> list[tuple[Pass, Action]]:
        return [(p, a) for p in self.order for a in p.select(program, policy)]

    def run(self, program: Program, policy: Any) -> Program:
        """Select every pass's actions first (selection changes nothing, and it is where policy
        mistakes surface), then insert; so a bad policy fails before the first change."""
        selected = {p.name: p.select(program, policy) for p in self.order}
        for p in self.order:
            touched = {}
            for action in selected[p.name]:
                gsite = program.site_graph(action.site.name)
                ins = gsite.insert(action.point, p.build(program, action), pass_name=p.name,
                                   tag=p.tag, extra=action.extra)
                program.record(ins)
                program.plan_rows.append(PlanRow(action.site.name, p.name, action.point, action.rule,
                                                 p.describe(action)))
                touched[id(gsite.gm)] = gsite.gm
            for gm in touched.values():  # lint after each pass: a broken graph names its pass
                try:
                    gm.graph.lint()
                except Exception as exc:
                    raise RuntimeError(f"pass {p.name!r} left an invalid graph: {exc}") from exc
                gm.recompile()
        return program


def default_passes() -> list[Pass]:
    """The standard pipeline: fake-quant, then noise, then instrumentation."""
    from qtransform.passes import default_passes as _defaults

    return _defaults()


def _load(policy: Any):
    from qtransform.schemas import load_policy

    return load_policy(policy)


def transform(
    model: nn.Module,
    policy: Any,
    example_inputs: Any = None,
    *,
    inplace: bool = False,
    mode: str = "module",
    passes: Iterable[Pass] | None = None,
    return_program: bool = False,
) -> nn.Module | Program:
    """Apply a policy (Policy, dict, JSON text or path) to a model and return the transformed one.

    By default the caller's model is left untouched (a deep copy is transformed), also when this
    raises; `inplace=True` transforms the given model and avoids the copy for large models (when
    it raises, the model is put back as it was: every spliced-in graph is replaced by the original
    submodule).
    """
    policy = _load(policy)
    manager = PassManager(list(passes) if passes is not None else default_passes())
    work = model if inplace else copy.deepcopy(model)
    program = capture(work, example_inputs, mode=mode)
    try:
        manager.run(program, policy)
    except BaseException:
        program.restore()  # inplace: the caller's model exactly as it was
        raise
    work.qtransform_log = [i.to_dict() for i in program.log] if mode == "module" else None
    return program if return_program else program.module()


def plan(model: nn.Module, policy: Any, example_inputs: Any = None,
         passes: Iterable[Pass] | None = None) -> Plan:
    """What `transform` would do, without doing it: every site with its selecting rules."""
    policy = _load(policy)
    manager = PassManager(list(passes) if passes is not None else default_passes())
    program = capture(model, example_inputs)
    rows = [PlanRow(a.site.name, p.name, a.point, a.rule, p.describe(a)) for p, a in manager.select(program, policy)]
    return Plan(list(program.sites.values()), rows)
