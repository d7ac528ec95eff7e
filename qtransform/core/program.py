"""Program: a model under transformation, with its site table, graphs and insertion log.

The Program is the one object every pass reads and writes: passes find sites here, get a
`GraphSite` for them, and every insertion is logged here, so plans, reports and the ONNX audit
all read the same record of what was done.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx
from torch import fx, nn

from qtransform.core.graph import GraphSite, Insertion
from qtransform.core.plan import Plan, PlanRow
from qtransform.core.sites import DENSE_KINDS, Site, closest_names
from qtransform.core.tracing import ModuleGraph, SiteTracer, detach, module_graph
from qtransform.errors import UserError

WHOLE_LOG_ATTR = "_qtransform_log"  # a whole-model graph module's insertions, in its __dict__


@dataclass
class WholeGraph:
    """The torch.export capture of the whole model and what was learned from it."""

    ep: Any  # torch.export.ExportedProgram
    gm: fx.GraphModule  # ep.module(): runnable, and where whole-graph passes insert
    nodes: dict[str, fx.Node]  # site name -> its op node (norms: their weight's get_attr)
    dag: nx.DiGraph  # dataflow between fx nodes, by node name
    order: list[str]  # site names in execution order
    log: list[Insertion] = field(default_factory=list)  # insertions into gm, kept on it

    def linears_fed_by(self, norm: str, sites: dict[str, Site]) -> list[str]:
        """Linear sites whose input is reached from the norm's output without crossing another
        linear or norm: the linears a norm's weight (and AQN noise on it) directly affects."""
        module_of = nx.get_node_attributes(self.dag, "module")
        owned = [n for n in self.dag.nodes if module_of.get(n) == norm]
        stops = {self.nodes[s].name: s for s in self.nodes if sites[s].kind in DENSE_KINDS}
        fed, seen = [], set(owned)
        frontier = [succ for n in owned for succ in self.dag.successors(n) if succ not in seen]
        while frontier:
            node = frontier.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in stops:
                fed.append(stops[node])
                continue
            module = module_of.get(node, "")
            if module in sites and sites[module].kind == "norm" and module != norm:
                continue
            frontier.extend(self.dag.successors(node))
        return sorted(fed, key=lambda s: sites[s].index)


@dataclass
class Program:
    """A model being transformed: site table, module graphs, whole-model graph, log."""

    model: nn.Module
    sites: dict[str, Site]
    whole: WholeGraph | None = None
    mode: str = "module"
    example_inputs: Any = None
    log: list[Insertion] = field(default_factory=list)
    plan_rows: list[PlanRow] = field(default_factory=list)  # filled by the pass manager
    plan_notes: list[str] = field(default_factory=list)  # each pass's notes, by the manager
    skipped_routers: dict[str, list[str]] = field(default_factory=dict)  # router -> sections passing it by
    preset_misses: list[str] = field(default_factory=list)  # preset entries matching no site (skipped)
    _graphs: dict[str, GraphSite] = field(default_factory=dict, repr=False)
    _trace: SiteTracer = field(default_factory=SiteTracer, repr=False)
    _states: dict[str, ModuleGraph] = field(default_factory=dict, repr=False)  # by module path

    # -- sites -----------------------------------------------------------------------------
    def site(self, name: str) -> Site:
        if name not in self.sites:
            hint = closest_names(name, list(self.sites))
            raise UserError(f"no site named {name!r}" + (f"; closest: {', '.join(hint)}" if hint else ""))
        return self.sites[name]

    def site_graph(self, name: str) -> GraphSite:
        """The graph of site `name`, attached to its module (or the whole graph) on first use."""
        if name in self._graphs:
            return self._graphs[name]
        site = self.site(name)
        if self.mode == "graph" and site.kind == "attention":
            raise UserError(f"{name}: attention sites are transformed in module mode (the "
                            "default); drop mode='graph'")
        if self.mode == "graph" or site.kind == "matmul":
            if self.whole is None:
                raise UserError(
                    f"site {name!r} lives only in the whole-model graph: pass example_inputs"
                )
            gm = self.whole.gm
            gsite = GraphSite(site, gm, gm, "", self.whole.log, op_node=self.whole.nodes[name])
        else:
            path = site.module_name  # an experts module holds several sites, all in one graph
            module = self.model.get_submodule(path)
            state = self._states.get(path) or self._trace(module, path)
            self._states[path] = state
            gsite = GraphSite(site, state, module, path, state.insertions)
        self._graphs[name] = gsite
        return gsite

    def restore(self) -> None:
        """Undo every change made to the model's site modules (a failed inplace transform):
        inserted children, the attached graph and the instance forward go, newest first."""
        for gsite in reversed(self._graphs.values()):
            if gsite.op_node is None:
                detach(gsite.owner, [i.module_path.rsplit(".", 1)[-1] for i in gsite.log] + gsite.replaced)
        self._graphs.clear()
        self._states.clear()
        self.log.clear()
        self.plan_rows.clear()
        self.plan_notes.clear()
        self.skipped_routers.clear()
        self.preset_misses.clear()

    def record(self, insertion: Insertion) -> None:
        self.log.append(insertion)

    def insertions(self, *, site: str | None = None, pass_name: str | None = None) -> list[Insertion]:
        return [
            i for i in self.log
            if (site is None or i.site == site) and (pass_name is None or i.pass_name == pass_name)
        ]

    # -- results ---------------------------------------------------------------------------
    def module(self) -> nn.Module:
        """The transformed model: the user's model with module graphs spliced in (module mode),
        or the whole-model graph module (graph mode)."""
        if self.mode == "graph":
            assert self.whole is not None
            return self.whole.gm
        return self.model

    def plan(self) -> Plan:
        """Every site with what each pass did to it (or nothing)."""
        return Plan(list(self.sites.values()), list(self.plan_rows),
                    list(self.plan_notes) + list(self.preset_misses),
                    {k: list(v) for k, v in self.skipped_routers.items()})


def insertion_log(model: nn.Module) -> list[Insertion]:
    """What qtransform inserted into `model`, read from the model itself, with module paths as
    they are now (after PEFT wrapping, say); empty for a model that was never transformed."""
    found: list[Insertion] = []
    for name, module in model.named_modules():
        state = module_graph(module)
        entries = state.insertions if state is not None else module.__dict__.get(WHOLE_LOG_ATTR, [])
        for ins in entries:
            attr = ins.module_path.rsplit(".", 1)[-1]
            found.append(replace(ins, module_path=f"{name}.{attr}" if name else attr))
    return found
