"""Program: a model under transformation, with its site table, graphs and insertion log.

The Program is the one object every pass reads and writes: passes find sites here, get a
`GraphSite` for them, and every insertion is logged here, so plans, reports and the ONNX audit
all read the same record of what was done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import fx, nn

from qtransform.errors import UserError
from qtransform.graph import GraphSite, Insertion
from qtransform.sites import Site
from qtransform.tracing import SiteTracer


@dataclass
class WholeGraph:
    """The torch.export capture of the whole model and what was learned from it."""

    ep: Any  # torch.export.ExportedProgram
    gm: fx.GraphModule  # ep.module(): runnable, and where whole-graph passes insert
    nodes: dict[str, fx.Node]  # site name -> its op node (norms: their weight's get_attr)
    dag: nx.DiGraph  # dataflow between fx nodes, by node name
    order: list[str]  # site names in execution order

    def linears_fed_by(self, norm: str, sites: dict[str, Site]) -> list[str]:
        """Linear sites whose input is reached from the norm's output without crossing another
        linear or norm: the linears a norm's weight (and AQN noise on it) directly affects."""
        module_of = nx.get_node_attributes(self.dag, "module")
        owned = [n for n in self.dag.nodes if module_of.get(n) == norm]
        stops = {self.nodes[s].name: s for s in self.nodes if sites[s].kind in ("linear", "conv1d")}
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
    plan_rows: list[Any] = field(default_factory=list)  # pipeline.PlanRow, filled by passes
    _graphs: dict[str, GraphSite] = field(default_factory=dict, repr=False)
    _trace: SiteTracer = field(default_factory=SiteTracer, repr=False)
    _spliced: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list, repr=False)

    # -- sites -----------------------------------------------------------------------------
    def site(self, name: str) -> Site:
        if name not in self.sites:
            from qtransform.schemas.selectors import closest_names

            hint = closest_names(name, list(self.sites))
            raise UserError(f"no site named {name!r}" + (f"; closest: {', '.join(hint)}" if hint else ""))
        return self.sites[name]

    def site_graph(self, name: str) -> GraphSite:
        """The graph holding site `name`, traced and spliced into the model on first use."""
        if name in self._graphs:
            return self._graphs[name]
        site = self.site(name)
        if self.mode == "graph" or site.kind == "matmul":
            if self.whole is None:
                raise UserError(
                    f"site {name!r} lives only in the whole-model graph: pass example_inputs"
                )
            gsite = GraphSite(site, self.whole.gm, "", op_node=self.whole.nodes[name])
        else:
            parent_name, _, attr = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            original = getattr(parent, attr)
            gm = self._trace(original)
            gm.train(original.training)
            # keep the original parameter order, so state_dict keys come out unchanged
            order = [k for k in original._parameters if k in gm._parameters]
            gm._parameters = {k: gm._parameters[k] for k in order + [k for k in gm._parameters if k not in order]}
            gm.qtransform_site = site.to_dict()  # survives deepcopy; says what this module was
            setattr(parent, attr, gm)
            self._spliced.append((parent, attr, original))
            gsite = GraphSite(site, gm, name)
        self._graphs[name] = gsite
        return gsite

    def restore(self) -> None:
        """Put every original submodule back where a module graph was spliced in (newest first),
        so a failed transform leaves the model as it found it."""
        for parent, attr, original in reversed(self._spliced):
            setattr(parent, attr, original)
        self._spliced.clear()
        self._graphs.clear()
        self.log.clear()
        self.plan_rows.clear()

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

    def plan(self):
        """Every site with what each pass does to it (or nothing): see `pipeline.Plan`."""
        from qtransform.pipeline import Plan

        return Plan(list(self.sites.values()), list(self.plan_rows))
