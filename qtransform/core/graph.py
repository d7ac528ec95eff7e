"""Site-level insertion helpers on fx graphs.

A pass says "put this module on the weight (or input, or output) of that site"; `GraphSite` finds
the value in whichever graph holds the site and rewires its uses through a new `call_module` node.
The same helper serves both granularities:

- module graphs: the site's own submodule traced with `torch.fx.symbolic_trace`; the weight is the
  `get_attr weight` node, the input the first placeholder, the output what the graph returns;
- the whole-model graph (`ep.module()` of a `torch.export` capture): the site is one `aten.linear`
  / `aten.addmm` / matmul node (or a norm's weight parameter), and only that node is rewired.

A fused experts parameter (`...experts.gate_up_proj`) is a site inside its module's decomposed
graph (`core/experts.py`): its points are the nodes tagged with (parameter, point) there, plus a
raw-only `counts` value (tokens per expert) for taps. In the whole-model graph it exposes its
weight (the parameter's `get_attr`, rewired for every use, like a norm's weight).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import fx, nn

from qtransform.core import attention
from qtransform.core.experts import COUNTS, POINT_META
from qtransform.core.sites import DENSE_KINDS, Site


class GraphHost(Protocol):
    """What runs a graph: a site module's ModuleGraph, or the whole-model GraphModule."""

    graph: fx.Graph

    def recompile(self) -> object: ...


Point = Literal["weight", "input", "output", "query", "key", "value", "probs", "kernel"]
POINTS: tuple[Point, ...] = ("weight", "input", "output")
ATTENTION_POINTS: tuple[Point, ...] = ("query", "key", "value", "output")  # probs: on demand


@dataclass(frozen=True)
class Insertion:
    """One logged insertion: which pass put which module where."""

    site: str
    point: str
    pass_name: str
    tag: str
    node: str
    module_path: str  # qualified name of the inserted module inside the transformed model

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _safe(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


class GraphSite:
    """A site inside one fx GraphModule, with helpers to insert modules at its points.

    Each point has a *raw* value (what the site computed on before any pass) and a *head* (the
    newest inserted node on it). An insertion consumes the head and becomes the new head, so
    later insertions stack closer to the consumer: fake-quant then tap means the tap sees the
    quantized weight, and can ask for the raw one as an extra argument. A module marked
    `rebases` (a rotation: a change of basis, not an error) also becomes the raw value.
    """

    def __init__(self, site: Site, host: GraphHost, owner: nn.Module, prefix: str,
                 log: list[Insertion], op_node: fx.Node | None = None):
        self.site = site
        self.host = host  # what runs the graph: the site module's ModuleGraph, or the whole graph
        self.graph = host.graph
        self.owner = owner  # the module inserted modules are added to
        self.prefix = prefix  # qualified name of `owner` inside the model ("" for the whole graph)
        self.log = log  # insertions into this graph, kept with the transformed model
        self.op_node = op_node  # whole-graph mode: the site's op node
        self.raw: dict[str, fx.Node] = {}
        for point in ATTENTION_POINTS if site.kind == "attention" else POINTS:
            try:
                self.raw[point] = self._locate(point)
            except ValueError:
                continue
        bias = self._bias()
        self.heads: dict[str, fx.Node] = dict(self.raw)
        self.replaced: list[str] = []  # children `replace_linear` added (not insertions)
        if bias is not None:  # readable as "raw:bias" (shadow computations), never a head
            self.raw["bias"] = bias
        counts = self._tagged(COUNTS) if site.param and op_node is None else None
        if counts is not None:  # experts: tokens per expert, readable as "raw:counts", never a head
            self.raw[COUNTS] = counts

    # -- locating values -------------------------------------------------------------------
    def value(self, point: str) -> fx.Node:
        """The newest node carrying `point` (`raw:<point>` for the value before any pass)."""
        table, key = (self.raw, point[4:]) if point.startswith("raw:") else (self.heads, point)
        if key == attention.PROBS and self.site.kind == "attention" and key not in table:
            self.raw[key] = self.heads[key] = attention.probs_node(self.graph)
        if key not in table:
            raise ValueError(
                f"{self.site.name}: point {key!r} is not available on a {self.site.kind} site "
                f"in {'the whole-model graph' if self.op_node is not None else 'module mode'}"
            )
        return table[key]

    def _locate(self, point: str) -> fx.Node:
        graph = self.graph
        if self.op_node is not None:
            return self._whole_graph_value(point)
        if self.site.param:
            return self._expert_value(point)
        if self.site.kind == "attention":
            return self._attention_value(point)
        if point == "weight":
            for node in graph.nodes:
                if node.op == "get_attr" and node.target == "weight":
                    return node
            raise ValueError(f"{self.site.name}: no weight in its graph")
        if point == "input":
            return next(n for n in graph.nodes if n.op == "placeholder")
        out = next(n for n in graph.nodes if n.op == "output")
        value = out.args[0]
        if self.site.role == "router" and isinstance(value, (tuple, list)) and value:
            value = value[0]  # a router returns (logits, scores, indices): its output is the logits
        if not isinstance(value, fx.Node):
            raise ValueError(f"{self.site.name}: output is not a single tensor")
        return value

    def _attention_value(self, point: str) -> fx.Node:
        """An attention graph's query/key/value (its placeholders) or output (`core/attention.py`)."""
        if point == "output":
            return next(n for n in self.graph.nodes if n.op == "output").args[0][0]
        node = next((n for n in self.graph.nodes if n.op == "placeholder" and n.target == point), None)
        if node is None:
            raise ValueError(f"{self.site.name}: an attention site has no {point}")
        return node

    def _tagged(self, point: str) -> fx.Node | None:
        """The node of the experts graph tagged (this site's parameter or any, for counts, point)."""
        for node in self.graph.nodes:
            tag = node.meta.get(POINT_META)
            if tag is not None and tag[1] == point and (point == COUNTS or tag[0] == self.site.param):
                return node
        return None

    def _expert_value(self, point: str) -> fx.Node:
        node = self._tagged(point)
        if node is None and point == "weight":  # an opaque experts graph: the parameter itself
            node = next((n for n in self.graph.nodes
                         if n.op == "get_attr" and n.target == self.site.param), None)
        if node is None:
            raise ValueError(f"{self.site.name}: no {point} in its experts graph")
        return node

    def _bias(self) -> fx.Node | None:
        """The node carrying a linear site's bias, or None (experts add theirs per row inside)."""
        if self.site.param:
            return None
        node = self.op_node
        if node is None:
            return next((n for n in self.graph.nodes if n.op == "get_attr" and n.target == "bias"), None)
        if self.site.kind not in DENSE_KINDS:
            return None
        if node.target == torch.ops.aten.addmm.default:
            bias = node.args[0]
        else:
            bias = node.args[2] if len(node.args) > 2 else None
        return bias if isinstance(bias, fx.Node) else None

    def _whole_graph_value(self, point: str) -> fx.Node:
        node = self.op_node
        assert node is not None
        if self.site.kind in ("norm", "experts"):
            if point != "weight":
                raise ValueError(f"{self.site.name}: a {self.site.kind} site exposes only its weight here")
            return node
        if point == "output":
            return node
        if self.site.kind == "matmul":
            if point == "weight":
                raise ValueError(f"{self.site.name}: a matmul has no weight")
            return node.args[0]
        if node.target == torch.ops.aten.addmm.default:  # Conv1D: addmm(bias, x, w)
            return node.args[1] if point == "input" else node.args[2]
        return node.args[0] if point == "input" else node.args[1]

    # -- inserting ---------------------------------------------------------------------------
    def insert(
        self, point: Point, module: nn.Module, *, pass_name: str, tag: str, extra: tuple[str, ...] = ()
    ) -> Insertion:
        """Route the site's `point` through `module`, called as `module(head, *extra_values)`;
        `extra` names other values (`"input"`, `"raw:weight"`, ...) the module also needs. An
        attention site's "kernel" is its attention call itself, which `module` replaces
        (`attention.replace_kernel`)."""
        if point == "kernel":
            return self._replace_kernel(module, pass_name, tag)
        head = self.value(point)
        extras = tuple(self.value(e) for e in extra)
        base = (f"{_safe(self.site.name)}__" if self.op_node is not None
                else f"{self.site.param}__" if self.site.param else "")
        attr = self._free_attr(f"{base}{point}_{tag}")
        self.owner.add_module(attr, module)
        graph = self.graph
        consumer = (self.op_node if self.op_node is not None and point != "output"
                    and self.site.kind not in ("norm", "experts") else None)
        anchor = max((head, *extras), key=self._position)
        with graph.inserting_before(consumer) if consumer is not None else graph.inserting_after(anchor):
            new = graph.call_module(attr, (head, *extras))
        new.meta.update({k: v for k, v in head.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
        new.meta["qtransform"] = {"site": self.site.name, "point": point, "pass": pass_name, "tag": tag}
        if consumer is not None:
            consumer.replace_input_with(head, new)
        else:
            head.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        self.heads[point] = new  # the caller lints and recompiles (once per pass, not per insertion)
        if getattr(module, "rebases", False):  # a change of basis (rotation): what later passes
            self.raw[point] = new  # measure against is the rotated full-precision value
        path = f"{self.prefix}.{attr}" if self.prefix else attr
        insertion = Insertion(self.site.name, point, pass_name, tag, new.name, path)
        self.log.append(insertion)
        return insertion

    def _replace_kernel(self, module: nn.Module, pass_name: str, tag: str) -> Insertion:
        """An attention site's attention call, or a Linear site's linear op (then called as
        `module(x_head, w_head, bias)`), replaced by `module`; logged as an insertion."""
        if self.op_node is not None or self.site.kind not in ("attention", "linear"):
            raise ValueError(f"{self.site.name}: only an attention or Linear site in module mode "
                             "has a kernel")
        if self.site.kind == "linear":
            new = self._swap_linear(module, "kernel_" + tag, lambda x, w, bias: (x, w, bias))
            attr = str(new.target)
        else:
            attr = self._free_attr(f"kernel_{tag}")
            self.owner.add_module(attr, module)
            new = attention.replace_kernel(self.graph, attr)
        new.meta["qtransform"] = {"site": self.site.name, "point": "kernel", "pass": pass_name, "tag": tag}
        path = f"{self.prefix}.{attr}" if self.prefix else attr
        insertion = Insertion(self.site.name, "kernel", pass_name, tag, new.name, path)
        self.log.append(insertion)
        return insertion

    def replace_linear(self, module: nn.Module, *, before: dict[str, fx.Node], tag: str) -> str:
        """Run the site's linear op through `module` instead, called as `module(x_head, w_head,
        bias, x_before, w_before)` (`before`: the nodes an operand had before a pass's insertion
        on it; the head itself otherwise): a Linear with its own backward. GPT-2's Conv1D op
        `addmm(bias, x, w)` is replaced alike. Not an insertion (nothing is logged; the forward
        computes the same values). Returns the child's name."""
        new = self._swap_linear(module, "linear_" + tag, lambda x, w, bias: (
            x, w, bias, before.get("input", x), before.get("weight", w)))
        self.replaced.append(str(new.target))
        return str(new.target)

    def _swap_linear(self, module: nn.Module, name: str, operands: Callable[..., tuple]) -> fx.Node:
        """The site's linear op replaced by a call of `module` (added as child `name`) on
        `operands(x, w, bias)`; the new node."""
        op = self.op_node if self.op_node is not None else next(
            (n for n in self.graph.nodes if n.op == "call_function" and n.target in _LINEAR_OPS), None)
        if op is None or op.target not in _LINEAR_OPS or (op.target in _ADDMM_OPS) != (self.site.kind == "conv1d"):
            raise ValueError(f"{self.site.name}: no linear op in its graph")
        if op.target in _ADDMM_OPS:
            bias, x, w = op.args[0], op.args[1], op.args[2]
        else:
            x, w = op.args[0], op.args[1]
            bias = op.args[2] if len(op.args) > 2 else op.kwargs.get("bias")
        base = f"{_safe(self.site.name)}__" if self.op_node is not None else ""
        attr = self._free_attr(f"{base}{name}")
        self.owner.add_module(attr, module)
        with self.graph.inserting_before(op):
            new = self.graph.call_module(attr, operands(x, w, bias))
        new.meta.update({k: v for k, v in op.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")})
        op.replace_all_uses_with(new)
        self.graph.erase_node(op)
        for table in (self.raw, self.heads):
            for point, node in table.items():
                if node is op:
                    table[point] = new
        if self.op_node is op:
            self.op_node = new
        return new

    def recompile(self) -> None:
        """Make the host run the edited graph (once per pass, after the lint), and tell each
        inserted module that may work in place whether it owns its input now (a later pass may
        have added a user of the value, so this is redone after every pass)."""
        self.host.recompile()
        for node in self.graph.nodes:
            if node.op == "call_module":
                module = self.owner.get_submodule(str(node.target))
                if hasattr(module, "owns_input"):
                    module.owns_input = _owned_input(node)

    def _position(self, node: fx.Node) -> int:
        for i, n in enumerate(self.graph.nodes):
            if n is node:
                return i
        raise ValueError(f"node {node.name} is not in the graph")

    def _free_attr(self, base: str) -> str:
        name, i = base, 1
        while hasattr(self.owner, name):
            i += 1
            name = f"{base}_{i}"
        return name


_ADDMM_OPS = (torch.addmm, torch.ops.aten.addmm.default)  # GPT-2's Conv1D: addmm(bias, x, w)
_LINEAR_OPS = (torch._C._nn.linear, nn.functional.linear, torch.ops.aten.linear.default, *_ADDMM_OPS)

# ops whose result is new memory, never a view of their inputs (a linear's bias form included:
# its view's base is the op's own buffer, which nothing else holds)
FRESH_OPS = frozenset({"linear", "addmm", "mm", "bmm", "matmul", "baddbmm", "scaled_dot_product_attention"})


def _owned_input(node: fx.Node) -> bool:
    """Whether `node`'s first argument is the fresh result of a compute op that `node` alone
    uses: then its module may overwrite it (no tap, instrument or other pass reads the value)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    producer = node.args[0]
    name = getattr(producer.target, "__name__", "").split(".")[0]
    others: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return (producer.op == "call_function" and name in FRESH_OPS and list(producer.users) == [node]
            and all(other is not producer for other in others))
