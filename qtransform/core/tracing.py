"""Module graphs: the fx graph a site module runs, attached to the module itself.

A transformed site stays the object it was: an `nn.Linear` is still that `nn.Linear`, with its
own Parameter objects, hooks and class, so PEFT can wrap it, FSDP2 can shard it and `isinstance`
checks hold. What changes is the forward of that one instance: it runs the site's fx graph, in
which passes insert modules (registered as children of the site module, so `.to()`, `.train()`
and `modules()` reach them; none of them has persistent state, so `state_dict()` is unchanged).
The generated code reads `self.weight` at every call, so whatever sits in the module's parameter
slot now (a merged LoRA weight, FSDP2's unsharded tensor) is what the graph computes with.

`torch.fx.symbolic_trace` gives the graph of Linear, Conv1D and the usual norms. A module whose
forward cannot be traced (control flow on tensor attributes, as in T5's LayerNorm, or a user's
Linear subclass) gets an *opaque* graph: its weight, input and output are graph values around one
call of the class's own forward. A fused experts module gets the decomposed graph of
`core/experts.py` (one weight, input and output point per expert parameter).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qtransform.core import attention
from qtransform.core.experts import decomposable, experts_graph
from qtransform.core.graph import Insertion
from qtransform.core.sites import expert_params
from qtransform.errors import UserError

ACCELERATE_HOOK = "_hf_hook"  # accelerate's hook; its wrapper calls `module._old_forward`
STATE_ATTR = "_qtransform"  # the ModuleGraph of a transformed module, in its __dict__
SELF_ATTR = "_qtransform_self"  # how an opaque graph names the module it belongs to


def _call_opaque(module: nn.Module, tensors: dict[str, torch.Tensor], *args, **kwargs):
    """The class forward of `module` with its own parameters/buffers taken from `tensors`."""
    for name, value in tensors.items():
        module.__dict__[name] = value  # shadows the parameter slot for this call only
    try:
        return type(module).forward(module, *args, **kwargs)
    finally:
        for name in tensors:
            module.__dict__.pop(name, None)


def _opaque_graph(module: nn.Module) -> fx.Graph:
    """A graph computing `module(...)` with its weight (and other own tensors) as values."""
    graph = fx.Graph()
    params = [p for p in inspect.signature(type(module).forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # drop self
    inputs = [graph.placeholder(p.name, default_value=p.default) if p.default is not p.empty
              else graph.placeholder(p.name) for p in params]
    own = [n for n, t in {**module._parameters, **module._buffers}.items() if t is not None]
    values = {n: graph.get_attr(n) for n in own}
    out = graph.call_function(_call_opaque, (graph.get_attr(SELF_ATTR), values, *inputs))
    graph.output(out)
    return graph


@dataclass
class ModuleGraph:
    """The graph one site module runs, and the insertions made into it.

    Lives in the module's `__dict__` (not a child module, not state), so it follows
    `copy.deepcopy` and never shows up in `state_dict()` or `named_modules()`.
    """

    module: nn.Module
    graph: fx.Graph
    insertions: list[Insertion] = field(default_factory=list)
    attention: bool = False  # an attention site: the graph is what its attention call runs

    def add_submodule(self, name: str, module: nn.Module) -> None:
        self.module.add_module(name, module)

    def has_attr(self, name: str) -> bool:
        return hasattr(self.module, name)

    def compile(self) -> Callable[..., Any]:
        """The graph as a Python function `forward(self, ...)` (`self` is the site module)."""
        code = self.graph.python_code(root_module="self")
        scope: dict[str, Any] = dict(code.globals)
        exec(compile(code.src, f"<qtransform site {type(self.module).__name__}>", "exec"), scope)  # noqa: S102
        return scope["forward"]

    def recompile(self) -> None:
        """Make the site module run the graph as it is now. Under an accelerate hook (offloaded
        or dispatched modules), the hook's wrapper stays the forward and calls the graph, after
        it has put the weights in place. An attention site's graph is not its forward: the
        module's attention call runs it (`core/attention.py`)."""
        if self.attention:
            self.module.__dict__[attention.GRAPH_ATTR] = GraphForward(self)
            attention.switch(self.module)
        elif ACCELERATE_HOOK in self.module.__dict__:
            self.module._old_forward = GraphForward(self)
        else:
            self.module.forward = GraphForward(self)


class GraphForward:
    """The instance forward of a transformed site: runs its graph with `self` = the module.

    An object rather than a bound method so that pickling (`torch.save(model)`) keeps it: it
    pickles the graph and compiles it again on load; `copy.deepcopy` follows the module."""

    def __init__(self, state: ModuleGraph):
        self.state = state
        self.fn = state.compile()
        self.__signature__ = inspect.Signature(list(inspect.signature(self.fn).parameters.values())[1:])

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self.fn(self.state.module, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"state": self.state}

    def __setstate__(self, data: dict[str, Any]) -> None:
        self.__init__(data["state"])


def module_graph(module: nn.Module) -> ModuleGraph | None:
    """The ModuleGraph of a transformed site module, or None."""
    return module.__dict__.get(STATE_ATTR)


def detach(module: nn.Module, inserted: list[str]) -> None:
    """Make a site module plain again: its inserted children, graph and instance forward go."""
    for name in inserted:
        module._modules.pop(name, None)
    for attr in (STATE_ATTR, SELF_ATTR):
        module.__dict__.pop(attr, None)
    if module.__dict__.pop(attention.GRAPH_ATTR, None) is not None:
        attention.restore(module)
    if isinstance(module.__dict__.get("forward"), GraphForward):
        del module.__dict__["forward"]
    if isinstance(module.__dict__.get("_old_forward"), GraphForward):  # under an accelerate hook
        module._old_forward = type(module).forward.__get__(module)


class SiteTracer:
    """Attaches graphs to site modules; every plain nn.Linear reuses one traced graph (their
    graphs are equal and tracing is most of the cost of a transform)."""

    def __init__(self) -> None:
        self._linear_graphs: dict[bool, fx.Graph] = {}

    def __call__(self, module: nn.Module, name: str) -> ModuleGraph:
        if module_graph(module) is not None:
            raise UserError(
                f"{name} is transformed already: transform the original model (a transform is "
                "not applied on top of another)"
            )
        graph = self._graph(module)
        graph.owning_module = module  # lint checks get_attr / call_module targets on it
        if any(n.op == "get_attr" and n.target == SELF_ATTR for n in graph.nodes):
            module.__dict__[SELF_ATTR] = module
        state = ModuleGraph(module, graph, attention=attention.is_attention(module))
        module.__dict__[STATE_ATTR] = state
        state.recompile()
        return state

    def _graph(self, module: nn.Module) -> fx.Graph:
        if attention.is_attention(module):
            return attention.attention_graph(SELF_ATTR)
        if type(module) is nn.Linear:
            return self._linear(module)
        if expert_params(module):
            return experts_graph(module) if decomposable(module) else _opaque_graph(module)
        try:
            graph = fx.symbolic_trace(module).graph
        except Exception:  # noqa: BLE001 - any trace failure: fall back to an opaque graph
            return _opaque_graph(module)
        if not any(n.op == "get_attr" and n.target == "weight" for n in graph.nodes):
            return _opaque_graph(module)  # weight reached in a way passes cannot see
        return graph

    def _linear(self, module: nn.Linear) -> fx.Graph:
        key = module.bias is None
        if key not in self._linear_graphs:
            self._linear_graphs[key] = fx.symbolic_trace(module).graph
        template = self._linear_graphs[key]
        graph = fx.Graph()
        graph.graph_copy(template, {}, return_output_node=False)
        out = next(n for n in template.nodes if n.op == "output")
        graph.output(next(n for n in graph.nodes if n.name == out.args[0].name))
        return graph
