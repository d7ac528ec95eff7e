"""Capture: a model becomes a Program (site table, and a whole-model graph when inputs are given).

Module graphs are traced lazily, site by site, when a pass first inserts on a site, so capture
itself is cheap and never copies weights. The whole-model graph comes from
`torch.export.export(..., strict=False)`, the one tracer that works on transformers 5 models.
"""

from __future__ import annotations

import inspect
import traceback
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from qtransform.core.experts import traceable_experts
from qtransform.core.program import WHOLE_LOG_ATTR, Program, WholeGraph
from qtransform.core.sites import DENSE_KINDS, Site, discover_sites, layer_index
from qtransform.errors import UserError

_LINEAR_OPS = (torch.ops.aten.linear.default, torch.ops.aten.addmm.default)
_MATMUL_OPS = {
    torch.ops.aten.matmul.default: "matmul",
    torch.ops.aten.bmm.default: "bmm",
    torch.ops.aten.scaled_dot_product_attention.default: "sdpa",
}


# what a model is called with: keyword inputs, positional inputs, or one positional tensor
ExampleInputs = torch.Tensor | tuple[object, ...] | list[object] | dict[str, object]


class CaptureError(UserError):
    """The whole-model graph could not be captured; names the construct that failed."""


def normalize_inputs(model: nn.Module, example_inputs: ExampleInputs) -> tuple[tuple, dict]:
    """(args, kwargs) for a model call; causal LMs get `use_cache=False` (export rejects caches)."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    params = forward_params(model)
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs["use_cache"] = False
    if args and "input_ids" in params and "input_ids" not in kwargs:
        kwargs["input_ids"], args = args[0], args[1:]
    return args, kwargs


def forward_params(model: nn.Module) -> Any:
    """The parameters of the model's forward (empty when it has no readable signature)."""
    try:
        return inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}


def with_attention_mask(model: nn.Module, example_inputs: ExampleInputs) -> dict[str, Any]:
    """The example inputs as keywords with an all-ones `attention_mask` beside `input_ids` (a
    given mask is kept), so that an export has a mask input and padded batches run through it."""
    args, kwargs = normalize_inputs(model, example_inputs)
    if "attention_mask" not in forward_params(model):
        raise UserError(f"{type(model).__name__}.forward takes no attention_mask; export it "
                        "without one (attention_mask=False, no --attention-mask)")
    ids = kwargs.get("input_ids")
    if args or not isinstance(ids, torch.Tensor):
        raise UserError("an attention_mask input needs example inputs given as input_ids "
                        "({'input_ids': ids} or one tensor of token ids)")
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    return kwargs


def _failing_construct(exc: BaseException) -> str:
    """The innermost frame of user or library code (not torch internals) where export failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}{where}"


def export_whole_graph(model: nn.Module, example_inputs: ExampleInputs) -> torch.export.ExportedProgram:
    """torch.export in non-strict mode; a failure names the construct that could not be traced."""
    args, kwargs = normalize_inputs(model, example_inputs)
    try:
        with torch.no_grad(), traceable_experts(model):
            return torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # noqa: BLE001 - every export failure gets the same explanation
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {_failing_construct(exc)}. "
            "Module mode still works: call capture/transform without example_inputs."
        ) from exc


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def build_whole_graph(model: nn.Module, sites: dict[str, Site], example_inputs: ExampleInputs) -> WholeGraph:
    """Map sites onto the exported graph, add matmul sites, and compute order and dataflow."""
    ep = export_whole_graph(model, example_inputs)
    gm = ep.module()
    nodes: dict[str, fx.Node] = {}
    matmul_counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(node.target, str) and node.target.endswith(".weight"):
            owner = node.target[: -len(".weight")]
            if owner in sites and sites[owner].kind == "norm":
                nodes.setdefault(owner, node)
        if node.op == "get_attr" and node.target in sites and sites[node.target].kind == "experts":
            nodes.setdefault(node.target, node)  # a fused expert parameter: its weight point
        if node.op != "call_function":
            continue
        path = _module_path(node)
        if node.target in _LINEAR_OPS and path in sites and sites[path].kind in DENSE_KINDS:
            nodes.setdefault(path, node)
        elif node.target in _MATMUL_OPS and path:
            k = matmul_counts.get(path, 0)
            matmul_counts[path] = k + 1
            name = f"{path}.{_MATMUL_OPS[node.target]}_{k}"
            sites[name] = Site(name, _MATMUL_OPS[node.target], "matmul", layer_index(name), "matmul")
            nodes[name] = node
    dag = nx.DiGraph()
    for node in gm.graph.nodes:
        dag.add_node(node.name, op=node.op, target=str(node.target), module=_module_path(node))
        for src in node.all_input_nodes:
            dag.add_edge(src.name, node.name)
    position = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    order = sorted(nodes, key=lambda name: position[nodes[name].name])
    for i, name in enumerate(order):
        sites[name].index = i
    whole = WholeGraph(ep=ep, gm=gm, nodes=nodes, dag=dag, order=order)
    gm.__dict__[WHOLE_LOG_ATTR] = whole.log  # the returned graph module carries what was done
    for name in order:
        if sites[name].kind == "norm":
            sites[name].feeds = whole.linears_fed_by(name, sites)
    return whole


def capture(model: nn.Module, example_inputs: ExampleInputs | None = None, *, mode: str = "module") -> Program:
    """Capture `model` into a Program.

    `mode="module"` (default) transforms module graphs spliced back into the model, which keeps
    its class and API; `mode="graph"` transforms the whole-model graph (needs example_inputs) and
    `Program.module()` then returns that graph module.
    """
    if mode not in ("module", "graph"):
        raise UserError(f"capture mode must be 'module' or 'graph', got {mode!r}")
    if mode == "graph" and example_inputs is None:
        raise UserError("capture(mode='graph') needs example_inputs to export the whole model")
    sites = discover_sites(model)
    whole = build_whole_graph(model, sites, example_inputs) if example_inputs is not None else None
    if whole is not None:
        sites = dict(sorted(sites.items(), key=lambda kv: (kv[0] not in whole.nodes, kv[1].index)))
    return Program(model, sites, whole=whole, mode=mode, example_inputs=example_inputs)
