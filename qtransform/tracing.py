"""Module graphs: a site's submodule as an fx GraphModule that passes can insert into.

`torch.fx.symbolic_trace` works for Linear, Conv1D and the usual norms. A module whose forward
cannot be traced (control flow on tensor attributes, as in T5's LayerNorm, or a user's Linear
subclass) still gets a module graph: an *opaque* one whose weight, input and output are graph
values around one call of the original forward. Passes cannot see inside it, and need not: they
only act on those three points. Parameter and buffer names stay where they were, so state_dict
keys do not change.
"""

from __future__ import annotations

import inspect

import torch
from torch import fx, nn


def _call_opaque(inner: nn.Module, tensors: dict[str, torch.Tensor], *args, **kwargs):
    """Run `inner` with its direct parameters/buffers taken from `tensors` (graph values)."""
    for name, value in tensors.items():
        inner.__dict__[name] = value
    try:
        return inner(*args, **kwargs)
    finally:
        for name in tensors:
            inner.__dict__.pop(name, None)


class _OpaqueRoot(nn.Module):
    """The attributes an opaque graph reads: the module's own tensors, and the module itself
    (emptied of them) as `inner`."""


def opaque_graph_module(module: nn.Module) -> fx.GraphModule:
    """A GraphModule computing `module(...)` with its weight (and other own tensors) as values."""
    inner = _clone_shell(module)
    root = _OpaqueRoot()
    names = list(module._parameters) + list(module._buffers)
    for name, p in module._parameters.items():
        if p is not None:
            root.register_parameter(name, p)
    for name, b in module._buffers.items():
        if b is not None:
            root.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)
    root.inner = inner
    graph = fx.Graph()
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    inputs = [graph.placeholder(p.name, default_value=p.default) if p.default is not p.empty
              else graph.placeholder(p.name) for p in params]
    values = {n: graph.get_attr(n) for n in names if getattr(module, n, None) is not None}
    out = graph.call_function(_call_opaque, (graph.get_attr("inner"), values, *inputs))
    graph.output(out)
    return fx.GraphModule(root, graph, class_name=type(module).__name__)


def _clone_shell(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` without its own parameters and buffers (children shared)."""
    shell = module.__class__.__new__(module.__class__)
    shell.__dict__.update(module.__dict__)
    shell._parameters, shell._buffers = {}, {}
    shell._non_persistent_buffers_set = set()
    shell._modules = dict(module._modules)
    return shell


class SiteTracer:
    """Traces site modules; every plain nn.Linear reuses one graph (their graphs are equal and
    tracing is most of the cost of a transform)."""

    def __init__(self) -> None:
        self._linear_graphs: dict[bool, fx.Graph] = {}

    def __call__(self, module: nn.Module) -> fx.GraphModule:
        if type(module) is nn.Linear:
            return self._linear(module)
        try:
            gm = fx.symbolic_trace(module)
        except Exception:  # noqa: BLE001 - any trace failure: fall back to an opaque graph
            return opaque_graph_module(module)
        if not any(n.op == "get_attr" and n.target == "weight" for n in gm.graph.nodes):
            return opaque_graph_module(module)  # weight reached in a way passes cannot see
        return gm

    def _linear(self, module: nn.Linear) -> fx.GraphModule:
        key = module.bias is None
        if key not in self._linear_graphs:
            self._linear_graphs[key] = fx.symbolic_trace(module).graph
        template = self._linear_graphs[key]
        graph = fx.Graph()
        graph.graph_copy(template, {}, return_output_node=False)
        out = next(n for n in template.nodes if n.op == "output")
        graph.output(next(n for n in graph.nodes if n.name == out.args[0].name))
        return fx.GraphModule(module, graph, class_name="Linear")
