"""Attention sites: the query, key, value and probabilities of a transformers attention module.

transformers 5 computes attention through its attention interface: a module projects q/k/v,
applies RoPE, writes the cache, and calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
(or the model file's `eager_attention_forward`) with the post-RoPE query and the key and value as
the cache holds them, in the layout [batch, heads, tokens, head_dim]. That call is where engines
and quantization stacks quantize (compressed-tensors hooks the same call, ModelOpt the bmm inputs
inside it), so it is where an attention site's points are:

- `query`, `key`, `value`: the call's three tensors (the key after RoPE, every cached token
  included, the current one too);
- `probs`: the softmax probabilities before their product with V (reached by computing the
  attention eagerly, as the model's eager function does, once a pass inserts there);
- `output`: the call's result ([batch, tokens, heads, head_dim]).

No model code is copied. A transformed model's attention modules share one config, so the
implementation it names is switched to a registered wrapper (`qtransform_<original>`) that runs
the original implementation exactly, except in modules that carry an attention graph: those run
their graph (`core/tracing.py` attaches it, in the module's `__dict__`), whose last node calls
the original implementation. With nothing inserted the outputs are the original ones bit for bit.
"""

from __future__ import annotations

import inspect
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, fx, nn

from qtransform.errors import UserError

GRAPH_ATTR = "_qtransform_attention"  # the attention graph's forward, in the module's __dict__
PREFIX = "qtransform_"  # the wrapper of implementation X is registered as qtransform_X
POINTS = ("query", "key", "value", "probs")  # the points a quantize rule names (plus output)
PROBS = "probs"


def is_attention(module: nn.Module) -> bool:
    """A transformers attention module: an `*Attention` class whose forward calls the attention
    interface (BERT's outer `BertAttention` does not; its `BertSelfAttention` does)."""
    cls = type(module)
    if not cls.__name__.endswith("Attention") or getattr(module, "config", None) is None:
        return False
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def attention_heads(module: nn.Module) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head_dim) from the module's config, or None when the config
    does not say (the `head` granularity then cannot be used there)."""
    config = module.config
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None)
    dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads)
    return heads, kv if isinstance(kv, int) else heads, int(dim)


def _implementation(module: nn.Module, name: str) -> Callable[..., Any]:
    """The function transformers would call for implementation `name` in `module`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
           implementation: str, options: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """The original attention: what the module computes without qtransform."""
    return _implementation(module, implementation)(module, query, key, value, attention_mask, **options)


def _wrapper(implementation: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None = None, **options: Any) -> Any:
        graph = module.__dict__.get(GRAPH_ATTR)
        if graph is None:
            return attend(module, query, key, value, attention_mask, implementation, options)
        return graph(query, key, value, attention_mask, implementation, options)

    attention.__name__ = f"{PREFIX}{implementation}"
    return attention


def _register(original: str) -> str:
    """The name of qtransform's wrapper of implementation `original`, registered on first use
    with the original's mask function."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"{PREFIX}{original}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _wrapper(original))
        if original in ALL_MASK_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def switch(module: nn.Module) -> None:
    """Make the module's config name qtransform's wrapper of its implementation, so that the
    module's graph runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = module.config
    original = config._attn_implementation or "eager"
    if original.startswith(PREFIX):
        return
    if original != "eager" and original not in ALL_ATTENTION_FUNCTIONS:
        raise UserError(f"{type(module).__name__}: attention implementation {original!r} is not "
                        "registered with transformers; load the model with attn_implementation "
                        '"sdpa" or "eager"')
    config._attn_implementation_internal = _register(original)


def running(current: str | None, wanted: str) -> str:
    """The implementation name that runs `wanted` in a model whose config names `current`:
    qtransform's wrapper of `wanted` when `current` is a wrapper (the attention graphs keep
    running), `wanted` itself otherwise."""
    return _register(wanted) if current and current.startswith(PREFIX) else wanted


def restore(module: nn.Module) -> None:
    """The module's config names its original implementation again."""
    config = module.config
    name = config._attn_implementation or ""
    if name.startswith(PREFIX):
        config._attn_implementation_internal = name.removeprefix(PREFIX)


def attention_graph(self_attr: str) -> fx.Graph:
    """The graph an attention site runs: its points as values around one call of the original
    implementation. `forward(self, query, key, value, attention_mask, implementation, options)`;
    `self_attr` is the attribute through which the graph reads its own module."""
    graph = fx.Graph()
    query, key, value, mask, implementation, options = (
        graph.placeholder(name) for name in ("query", "key", "value", "attention_mask",
                                             "implementation", "options"))
    result = graph.call_function(attend, (graph.get_attr(self_attr), query, key, value, mask,
                                          implementation, options))
    output = graph.call_function(operator.getitem, (result, 0))
    weights = graph.call_function(operator.getitem, (result, 1))
    graph.output((output, weights))
    return graph


def _attend_node(graph: fx.Graph, what: str) -> fx.Node:
    call = next((n for n in graph.nodes if n.op == "call_function" and n.target is attend), None)
    if call is None:
        raise UserError(f"{what}: the attention already runs an engine's kernel or computes its "
                        "probabilities eagerly; an engine kernel and the probs point exclude each "
                        "other (the kernel rounds its probabilities itself)")
    return call


def replace_kernel(graph: fx.Graph, attr: str) -> fx.Node:
    """Run the child module `attr` instead of the original implementation, called as
    `attr(module, query, key, value, attention_mask, options)` with the graph's current values
    (`module`: the attention module itself)."""
    call = _attend_node(graph, "kernel")
    module, query, key, value, mask, _, options = call.args
    with graph.inserting_before(call):
        new = graph.call_module(attr, (module, query, key, value, mask, options))
    call.replace_all_uses_with(new)
    graph.erase_node(call)
    return new


def probs_node(graph: fx.Graph) -> fx.Node:
    """The graph's probabilities, splitting the one `attend` call into the eager computation
    (`attention_probs`, then `attention_values`) the first time they are asked for."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is attention_probs:
            return node
    call = _attend_node(graph, "probs")
    module, query, key, value, mask, _, options = call.args
    with graph.inserting_before(call):
        probs = graph.call_function(attention_probs, (module, query, key, mask, options))
        result = graph.call_function(attention_values, (probs, value))
    call.replace_all_uses_with(result)
    graph.erase_node(call)
    return probs


def _groups(module: nn.Module, query: Tensor, key: Tensor) -> int:
    return getattr(module, "num_key_value_groups", None) or query.shape[1] // key.shape[1]


def _repeat(x: Tensor, groups: int) -> Tensor:
    """GQA: each key/value head repeated for the query heads that share it."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def attention_probs(module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None,
                    options: dict[str, Any]) -> Tensor:
    """softmax(q·kᵀ·scaling + mask) in fp32, cast to the query's dtype, as transformers' eager
    attention computes it. The mask is whichever the model built for its implementation: an
    additive float mask, a boolean one (sdpa), or none (sdpa's causal shortcut)."""
    if options.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise UserError(f"{type(module).__name__}: its attention has logit soft-capping or sinks, "
                        'which the "probs" point does not compute; leave probs out of the rule '
                        "for this model")
    keys = _repeat(key, _groups(module, query, key))
    scaling = options.get("scaling")
    scores = torch.matmul(query, keys.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    q_len, k_len = scores.shape[-2:]
    low = torch.finfo(scores.dtype).min
    if attention_mask is None:
        if q_len > 1 and getattr(module, "is_causal", True):
            causal = torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(k_len - q_len)
            scores = scores.masked_fill(~causal, low)
    elif attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., :k_len], low)
    else:
        scores = scores + attention_mask[..., :k_len]
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return nn.functional.dropout(probs, p=float(options.get("dropout", 0.0) or 0.0), training=module.training)


def attention_values(probs: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """probs·V in the layout attention modules expect ([batch, tokens, heads, head_dim]), and the
    probabilities as the attention weights."""
    values = _repeat(value, probs.shape[1] // value.shape[1])
    return torch.matmul(probs, values).transpose(1, 2).contiguous(), probs
