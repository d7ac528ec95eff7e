"""Fused mixture-of-experts modules as graphs with a weight, input and output point per expert
matmul.

transformers 5 keeps the experts of one layer in one module (`MixtralExperts`, `Qwen3MoeExperts`,
...) holding 3-D parameters: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] ([E, in, out]
when the module says `is_transposed`), applied by an "experts implementation" (a per-expert loop,
a batched or a grouped matmul) chosen in the config. A site is one such parameter. Its module keeps
its class and parameters; what it runs is the graph built here, in which the computation is
decomposed so that every matmul operand is a graph value:

    tokens, ids, counts, order, w = dispatch(hidden, top_k_index, top_k_weights)
    x1 = tokens                              input of the gate_up site   [S, H], grouped by expert
    y1 = grouped_linear(x1, gate_up_proj)    output of the gate_up site  [S, 2I]
    x2 = gate(y1)                            input of the down site      [S, I]
    y2 = grouped_linear(x2, down_proj)       output of the down site     [S, H]
    out = combine(y2, w, order)

S = tokens x top_k rows, sorted by expert (`torch.sort`, as transformers sorts them), so expert e's token slice is one run of
`counts[e]` rows. Activation formats block along the feature axis within each row, so a
fake-quant on the grouped tensor equals a fake-quant of each expert's token slice (an NVFP4
activation's tensor scale is then that of the grouped tensor: one scale per site, as one grouped
GEMM would use). Eager runs multiply each expert's slice by its matrix; traced runs (torch.export,
ONNX) gather each row's matrix and use one batched matmul, which has static shapes and a plain
ONNX translation (Gather + MatMul) where the grouped matmul op has none.

The arithmetic follows transformers' `grouped_mm` implementation (the default): rows sorted by
expert, matrices applied per slice, outputs weighted, put back in token order and summed over
top_k. Biases (`gate_up_proj_bias`, `down_proj_bias`) are added per row.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, fx, nn

from qtransform.core import ops
from qtransform.core.observers import collecting, route
from qtransform.core.sites import expert_params

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None)  # torch >= 2.10 (CPU and CUDA)
POINT_META = "qtransform_experts"  # node.meta key: (parameter name, point) of an experts value
COUNTS = "counts"  # the point name of the tokens-per-expert value (raw only, for taps)


def decomposable(module: nn.Module) -> bool:
    """Whether the module follows transformers' experts contract that `experts_graph` decomposes:
    a gate_up (or up) and a down parameter and an activation; post-expert norms and expert
    parallelism are not decomposed (such modules get weight points only)."""
    has_up = isinstance(module._parameters.get("gate_up_proj"), nn.Parameter) or isinstance(
        module._parameters.get("up_proj"), nn.Parameter)
    return (has_up and isinstance(module._parameters.get("down_proj"), nn.Parameter)
            and hasattr(module, "act_fn") and not getattr(module, "has_post_expert_norm", False)
            and not getattr(module, "_is_expert_parallel", False))


def dispatch(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, num_experts: int
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(token rows grouped by expert [S, H], their expert ids [S], tokens per expert [E] int64,
    the sort permutation [S], the routing weight of each grouped row [S])."""
    k = top_k_index.size(-1)
    ids, perm = torch.sort(top_k_index.reshape(-1))  # the order transformers uses
    rows = hidden[perm // k]
    if collecting():  # a calibration run: observers map the rows to the batch's tokens
        route(perm // k, hidden.shape[0])
    weights = top_k_weights.reshape(-1)[perm]
    experts = torch.arange(num_experts, device=ids.device)
    counts = (ids.unsqueeze(-1) == experts).sum(0)  # static shape, unlike bincount
    return rows, ids, counts, perm, weights


def grouped_linear(x: Tensor, weight: Tensor, ids: Tensor, counts: Tensor, transposed: bool,
                   bias: Tensor | None = None) -> Tensor:
    """Row r of x times the matrix of expert ids[r] (rows grouped by expert, `counts` per expert).

    Eager: torch's grouped matmul where it exists (what transformers' default `grouped_mm`
    implementation runs, so results are bit-identical to it), else one matmul per expert slice;
    an expert without tokens costs nothing. Traced: each row's matrix gathered and one batched
    matmul (static shapes for export and ONNX)."""
    if ops.is_tracing(x) or ops.is_tracing(weight):
        w = weight[ids]  # [S, out, in] or [S, in, out]
        if transposed:
            out = torch.bmm(x.unsqueeze(1), w).squeeze(1)
        else:
            out = torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    elif _GROUPED_MM is not None and x.dtype == weight.dtype:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        out = _GROUPED_MM(x, weight if transposed else weight.transpose(-2, -1), offs=offsets)
    else:
        out_dim = weight.shape[-1] if transposed else weight.shape[-2]
        out = x.new_zeros(x.shape[0], out_dim)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                w = weight[e]
                out[start:start + n] = x[start:start + n] @ (w if transposed else w.t())
            start += n
    if bias is not None:
        out = out + bias[ids]
    return out


def gate(module: nn.Module, y: Tensor) -> Tensor:
    """The gated activation between the two matmuls (the module's own `_apply_gate` if any)."""
    if isinstance(module._parameters.get("gate_up_proj"), nn.Parameter):
        apply = getattr(module, "_apply_gate", None)
        if apply is not None:
            return apply(y)
        g, u = y.chunk(2, dim=-1)
        return module.act_fn(g) * u
    return module.act_fn(y)


def combine(y: Tensor, weights: Tensor, perm: Tensor, num_tokens: int, k: int, dtype: torch.dtype) -> Tensor:
    """Weighted expert outputs back in token order, summed over each token's top_k experts."""
    weighted = y * weights.unsqueeze(-1)
    restored = torch.empty_like(weighted).index_copy(0, perm, weighted)
    return restored.view(num_tokens, k, y.shape[-1]).sum(dim=1).to(dtype)


def _num_experts(module: nn.Module) -> int:
    return int(module._parameters["down_proj"].shape[0])


def _tag(node: fx.Node, param: str, point: str) -> fx.Node:
    node.meta[POINT_META] = (param, point)
    return node


def experts_graph(module: nn.Module) -> fx.Graph:
    """The graph of a decomposable experts module (see the module docstring); `self` is the
    module, each parameter a `get_attr`, each point a node tagged in `node.meta[POINT_META]`."""
    graph = fx.Graph()
    hidden = graph.placeholder("hidden_states")
    index = graph.placeholder("top_k_index")
    weights_in = graph.placeholder("top_k_weights")
    me = graph.get_attr("_qtransform_self")
    up = "gate_up_proj" if isinstance(module._parameters.get("gate_up_proj"), nn.Parameter) else "up_proj"
    transposed = bool(getattr(module, "is_transposed", False))
    parts = graph.call_function(dispatch, (hidden, index, weights_in, _num_experts(module)))
    rows, ids, counts, perm, weights = (graph.call_function(operator.getitem, (parts, i)) for i in range(5))
    _tag(counts, up, COUNTS)
    _tag(rows, up, "input")

    def bias(param: str) -> fx.Node | None:
        return graph.get_attr(f"{param}_bias") if getattr(module, "has_bias", False) else None

    w1 = _tag(graph.get_attr(up), up, "weight")
    y1 = _tag(graph.call_function(grouped_linear, (rows, w1, ids, counts, transposed, bias(up))), up, "output")
    x2 = _tag(graph.call_function(gate, (me, y1)), "down_proj", "input")
    w2 = _tag(graph.get_attr("down_proj"), "down_proj", "weight")
    y2 = _tag(graph.call_function(grouped_linear, (x2, w2, ids, counts, transposed, bias("down_proj"))),
              "down_proj", "output")
    num_tokens = graph.call_function(_rows_of, (hidden,))
    k = graph.call_function(_last_dim, (index,))
    out = graph.call_function(combine, (y2, weights, perm, num_tokens, k, _dtype_of_node(graph, hidden)))
    graph.output(out)
    return graph


def _dtype_of_node(graph: fx.Graph, node: fx.Node) -> fx.Node:
    return graph.call_function(_dtype_of, (node,))


def _rows_of(x: Tensor) -> int:
    return x.shape[0]


def _last_dim(x: Tensor) -> int:
    return x.shape[-1]


def _dtype_of(x: Tensor) -> torch.dtype:
    return x.dtype


def fake_quantize_experts(w: Tensor, quantize: Callable[[Tensor], Tensor]) -> Tensor:
    """`quantize` applied to each expert's matrix on its own (axis 0 indexes experts), as each
    would be quantized as an nn.Linear weight: NVFP4's tensor scale is one per expert."""
    return torch.stack([quantize(w[e]) for e in range(w.shape[0])])



@contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """Experts modules that run transformers' own forward (not transformed) use its `batched_mm`
    implementation for the block: a gather and a batched matmul, which torch.export and ONNX
    translate, where the default grouped matmul op (`transformers::grouped_mm_fallback`) has no
    ONNX translation. Each config's choice is restored afterwards."""
    configs = {id(c): c for m in model.modules()
               if expert_params(m) and (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) not in (None, "eager", "batched_mm")}
    before = {k: c._experts_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        yield
    finally:
        for k, c in configs.items():
            c._experts_implementation = before[k]
