"""Sites: the places a pass can act on, and the site table of a model.

A site is a Linear (or GPT-2's Conv1D, whose weight is stored [in, out]; or a mixture-of-experts
router, a module holding a 2-D `weight` applied with `F.linear`: see `router_names`), a fused expert parameter (one
3-D `gate_up_proj` / `up_proj` / `down_proj` of a transformers 5 experts module: E matrices, one per
expert, each multiplied like a Linear weight), a norm (any RMSNorm or LayerNorm class, whatever
library defines it), an attention module (its query, key, value and probabilities: see
`core/attention.py`), or, in the whole-model graph, an attention matmul.
Selection, plans, reports and ONNX node names all refer to sites by their fully-qualified module
name, so this module is the one place that decides names, layer indices and roles.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from qtransform.core.attention import attention_heads, is_attention

REGEX_PREFIX = "re:"  # a selector that is a regular expression, not a glob

SiteKind = Literal["linear", "conv1d", "experts", "norm", "attention", "matmul"]
ATTENTION_KIND = "attention"  # an attention module: its query, key, value and probabilities
DENSE_KINDS: tuple[str, ...] = ("linear", "conv1d")  # one 2-D weight, one linear op in a graph
LINEAR_KINDS: tuple[str, ...] = (*DENSE_KINDS, "experts")  # `Linear` means these, routers excepted
EXPERT_PARAMS = {"gate_up_proj": "experts.gate_up", "up_proj": "experts.up", "down_proj": "experts.down"}

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")
_ROLE_BY_LEAF = {
    "q_proj": "q", "query": "q", "k_proj": "k", "key": "k", "v_proj": "v", "value": "v",
    "o_proj": "o", "out_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "w1": "gate", "w3": "up", "w2": "down", "fc1": "fc1", "fc2": "fc2", "c_fc": "up",
    "c_attn": "qkv", "qkv_proj": "qkv", "lm_head": "lm_head", "gate_up_proj": "gate_up",
}


PEFT_PREFIX = "base_model.model."  # what get_peft_model puts before the model's own names
ADAPTER_KEYS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def peft_view(name: str) -> tuple[str, bool]:
    """(the name a user writes for this module, whether it is a PEFT adapter module).

    PEFT renames what it wraps: `q_proj` becomes `q_proj.base_layer` beside
    `q_proj.lora_A.default`; `q_proj` and `lora_A` are what users mean and write."""
    parts = name.split(".")
    if parts[-1] == "base_layer":
        return ".".join(parts[:-1]), False
    for i, part in enumerate(parts):
        if part in ADAPTER_KEYS:
            return ".".join(parts[: i + 1]), True
    return name, False


def hf_name(name: str) -> str:
    """The base model's own name of a module or tensor: PEFT's prefix and `base_layer` removed."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").removesuffix(".base_layer")


def layer_index(name: str) -> int | None:
    """Decoder/encoder layer index parsed from a module path (`model.layers.14.mlp` -> 14)."""
    match = _LAYER_RE.search(name)
    return int(match.group(1)) if match else None


def role_of(name: str, kind: SiteKind) -> str:
    """The conventional role of a site (q/k/v/o, gate/up/down, lm_head, norm...) from its path."""
    if kind in ("norm", "attention"):
        return kind
    if kind == "matmul":
        return "matmul"
    parts = name.split(".")
    leaf = parts[-1]
    if leaf in _ROLE_BY_LEAF:
        return _ROLE_BY_LEAF[leaf]
    parent = parts[-2] if len(parts) > 1 else ""
    if leaf == "c_proj":  # GPT-2: attn.c_proj is the output projection, mlp.c_proj the down one
        return "o" if parent == "attn" else "down"
    if leaf == "dense":  # BERT: attention.output.dense, intermediate.dense, output.dense
        grand = parts[-3] if len(parts) > 2 else ""
        if parent == "output" and grand == "attention":
            return "o"
        if parent == "intermediate":
            return "up"
        if parent == "output":
            return "down"
    return "other"


def expert_params(module: nn.Module) -> list[str]:
    """The fused 3-D expert parameters a module holds ([E, out, in], or [E, in, out] when the
    module says `is_transposed`), in EXPERT_PARAMS order; [] for any other module."""
    return [n for n in EXPERT_PARAMS
            if isinstance(p := module._parameters.get(n), nn.Parameter) and p.ndim == 3]


def is_router(module: nn.Module) -> bool:
    """A router class of its own (`MixtralTopKRouter`, `Qwen3MoeTopKRouter`, `Llama4Router`, ...):
    a `*Router` module holding a 2-D `weight` that it applies with `F.linear`, so a Linear in all
    but class."""
    weight = module._parameters.get("weight")
    return (type(module).__name__.endswith("Router") and isinstance(weight, nn.Parameter)
            and weight.ndim == 2)


ROUTER_ROLE = "router"
ROUTER_ATTRS = ("gate", "router", "shared_expert_gate")  # ModelOpt's names of an MoE block's routers


def router_names(model: nn.Module) -> set[str]:
    """The modules of a model whose output picks or weighs experts: what every deployment stack
    keeps in high precision (llm-compressor's `re:.*mlp.gate$`, ModelOpt's disabled `*router*`,
    `*mlp.gate.*` and `*mlp.shared_expert_gate.*`, vLLM's unquantized gate).

    A router is a `*Router` class with its own 2-D weight (`is_router`), or, the rule ModelOpt's
    export applies, the `gate` / `router` / `shared_expert_gate` child of a module that holds an
    `experts` child: an `nn.Linear` gate (older MoE classes, remote code, Qwen2-MoE's shared-expert
    gate, whose sigmoid weighs the shared expert), or, when that child has no weight of its own,
    every Linear inside it (DBRX's `router.layer`, Gemma 4's `router.proj`)."""
    names = {name for name, module in model.named_modules() if name and is_router(module)}
    for name, module in model.named_modules():
        if module._modules.get("experts") is None:
            continue
        for attr in ROUTER_ATTRS:
            child = module._modules.get(attr)
            if child is None:
                continue
            prefix = f"{name}.{attr}" if name else attr
            if isinstance(child._parameters.get("weight"), nn.Parameter):
                names.add(prefix)
            else:
                names.update(f"{prefix}.{sub}" for sub, m in child.named_modules()
                             if sub and classify(m) in DENSE_KINDS)
    return names


def is_router_path(name: str, experts_modules: set[str]) -> bool:
    """`router_names` for a checkpoint, which has names and no modules: a `gate` / `router` /
    `shared_expert_gate` beside one of `experts_modules`, or a weight directly inside one."""
    parts = name.split(".")
    return any(len(parts) > depth and parts[-depth] in ROUTER_ATTRS
               and ".".join([*parts[:-depth], "experts"]) in experts_modules for depth in (1, 2))


def is_norm_class(cls_name: str) -> bool:
    """Any RMSNorm/LayerNorm class, matched by name so every library's class counts."""
    return cls_name.endswith("RMSNorm") or cls_name.endswith("LayerNorm")


@dataclass
class Site:
    """One place a pass can act on, with everything selection and reports need to know."""

    name: str
    cls_name: str
    kind: SiteKind
    layer: int | None
    role: str
    weight_shape: tuple[int, ...] | None = None
    weight_transposed: bool = False  # Conv1D stores [in, out]; experts [E, in, out] when set
    index: int = 0  # position in module order (execution order once a whole graph exists)
    alias: str | None = None  # the name users write when PEFT renamed the module (see peft_view)
    adapter: bool = False  # a PEFT adapter (lora_A, lora_B, ...): only selected when named
    feeds: list[str] = field(default_factory=list)  # norms: the linears their output reaches
    param: str | None = None  # experts: the 3-D parameter of module `module_name` this site is
    heads: tuple[int, int, int] | None = None  # attention: query heads, key/value heads, head_dim

    @property
    def module_name(self) -> str:
        """The module that holds this site's weight (experts: the experts module)."""
        return self.name.rsplit(".", 1)[0] if self.param else self.name

    @property
    def expert_axis(self) -> int | None:
        """The axis of the weight that indexes experts (0 for an experts site, else None)."""
        return 0 if self.kind == "experts" else None

    @property
    def num_experts(self) -> int | None:
        return self.weight_shape[0] if self.kind == "experts" and self.weight_shape else None

    @property
    def reduction_axis(self) -> int:
        """Axis of the weight along which blocks run: the input-feature (reduction) axis, the
        same for each expert's matrix as for that matrix in an nn.Linear."""
        if self.kind == "experts":
            return -2 if self.weight_transposed else -1
        return 0 if self.weight_transposed else -1

    def to_dict(self) -> dict:
        return {
            "name": self.name, "class": self.cls_name, "kind": self.kind, "layer": self.layer,
            "role": self.role, "weight_shape": list(self.weight_shape) if self.weight_shape else None,
            "weight_transposed": self.weight_transposed, "feeds": list(self.feeds),
            "adapter": self.adapter, "param": self.param, "num_experts": self.num_experts,
            "heads": list(self.heads) if self.heads else None,
        }


def classify(module: nn.Module) -> SiteKind | None:
    """The site kind of a module, or None when passes do not act on it."""
    cls_name = type(module).__name__
    if isinstance(module, nn.Linear):
        return "linear"
    if cls_name == "Conv1D" and getattr(module, "weight", None) is not None:
        return "conv1d"
    if is_norm_class(cls_name) and isinstance(getattr(module, "weight", None), nn.Parameter):
        return "norm"
    if is_router(module):
        return "linear"
    if is_attention(module):
        return "attention"
    return None


def discover_sites(model: nn.Module) -> dict[str, Site]:
    """The site table of a model in module order: every Linear, Conv1D, router (role `router`,
    see `router_names`), fused expert parameter, norm and attention module. Plans, transforms and
    every scan read this one table."""
    sites: dict[str, Site] = {}
    routers = router_names(model)
    for name, module in model.named_modules():
        if name:
            for param in expert_params(module):
                _add_expert_site(sites, module, name, param)
        kind = classify(module)
        if kind is None or not name:
            continue
        weight = getattr(module, "weight", None) if kind != "attention" else None
        alias, adapter = peft_view(name)
        sites[name] = Site(
            name=name,
            cls_name=type(module).__name__,
            kind=kind,
            layer=layer_index(name),
            role=ROUTER_ROLE if name in routers else role_of(alias, kind),
            alias=alias if alias != name else None,
            adapter=adapter,
            weight_shape=tuple(weight.shape) if weight is not None else None,
            weight_transposed=kind == "conv1d",
            index=len(sites),
            heads=attention_heads(module) if kind == "attention" else None,
        )
    return sites

def _add_expert_site(sites: dict[str, Site], module: nn.Module, name: str, param: str) -> None:
    alias, adapter = peft_view(name)
    site_name = f"{name}.{param}"
    sites[site_name] = Site(
        name=site_name, cls_name=type(module).__name__, kind="experts", layer=layer_index(name),
        role=EXPERT_PARAMS[param], alias=f"{alias}.{param}" if alias != name else None,
        adapter=adapter, weight_shape=tuple(module._parameters[param].shape),
        weight_transposed=bool(getattr(module, "is_transposed", False)), index=len(sites),
        param=param,
    )


def closest_names(entry: str, names: Sequence[str], n: int = 3) -> list[str]:
    """Up to n site names that look like `entry` (compared whole and by last dotted part)."""
    core = entry.removeprefix(REGEX_PREFIX).strip("*?.^$")
    by_key: dict[str, str] = {}
    for name in names:
        by_key.setdefault(name, name)
        by_key.setdefault(name.rsplit(".", 1)[-1], name)
    keys = difflib.get_close_matches(core, list(by_key), n=n * 3, cutoff=0.6)
    out: list[str] = []
    for key in keys:
        if by_key[key] not in out:
            out.append(by_key[key])
    return out[:n]
