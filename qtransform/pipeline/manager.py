"""PassManager: runs passes in dependency order, hands each its typed policy section, lints and
logs every insertion.

Passes declare what they require and provide; the order is a networkx topological sort (missing
providers and cycles are errors naming the passes). A failure inside a pass that is not the
user's mistake is re-raised naming the pass and the passes that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import networkx as nx

from qtransform.core.plan import PlanRow
from qtransform.core.program import Program
from qtransform.errors import UserError
from qtransform.pipeline.base import Action, Pass, payload_type
from qtransform.schemas import Policy

T = TypeVar("T")  # what a guarded pass hook returns


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

    def _guarded(self, p: Pass, what: str, fn: Callable[..., T], *args: object) -> T:
        """Call a pass hook; a bug (not a user mistake) names the pass and those before it."""
        try:
            return fn(*args)
        except UserError:
            raise
        except Exception as exc:
            before = [q.name for q in self.order[: self.order.index(p)]]
            raise RuntimeError(
                f"pass {p.name!r} failed in {what} (after passes {before}): {type(exc).__name__}: {exc}"
            ) from exc

    def _actions(self, p: Pass, program: Program, policy: Policy) -> list[Action]:
        spec = policy.section(p.section)
        if spec is None or spec == []:
            return []
        actions = self._guarded(p, "select", p.select, program, spec)
        want = type(p).payload_type or payload_type(type(p))  # unregistered passes too
        for action in actions:
            if want is not None and not isinstance(action.payload, want):
                raise RuntimeError(f"pass {p.name!r} selected an action with a "
                                   f"{type(action.payload).__name__} payload; it declares {want.__name__}")
        return actions

    def select(self, program: Program, policy: Policy) -> list[tuple[Pass, Action]]:
        """Every (pass, action) the policy asks for, in pipeline order; nothing is changed."""
        return [(p, a) for p in self.order for a in self._actions(p, program, policy)]

    def run(self, program: Program, policy: Policy) -> Program:
        """Select every pass's actions first (selection changes nothing, and it is where policy
        mistakes surface), then insert; so a bad policy fails before the first change."""
        for p in self.order:
            if program.mode not in p.modes and policy.section(p.section):
                raise UserError(f"the policy's {p.section!r} section works in "
                                f"{' or '.join(repr(m) for m in p.modes)} mode only; drop "
                                f"mode={program.mode!r} (module mode is the default)")
        selected = {p.name: self._actions(p, program, policy) for p in self.order}
        for p in self.order:
            program.plan_notes += p.notes(selected[p.name])
            touched = {}
            for action in selected[p.name]:
                gsite = program.site_graph(action.site.name)
                module = self._guarded(p, "build", p.build, program, action)
                ins = gsite.insert(action.point, module, pass_name=p.name, tag=p.tag, extra=action.extra)
                program.record(ins)
                program.plan_rows.append(PlanRow(action.site.name, p.name, action.point, action.rule,
                                                 p.describe(action)))
                touched[id(gsite.graph)] = gsite
            self._guarded(p, "finish", p.finish, program, selected[p.name])
            for gsite in touched.values():  # lint after each pass: a broken graph names its pass
                try:
                    gsite.graph.lint()
                except Exception as exc:
                    raise RuntimeError(f"pass {p.name!r} left an invalid graph: {exc}") from exc
                gsite.recompile()
        return program
