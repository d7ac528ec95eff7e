"""Where a weight scan's tensors come from: a module's sites, or a safetensors checkpoint read
lazily one tensor at a time (mixture-of-experts tensors merged as transformers merges them).

A `WeightRef` is one weight with its site and a loader, so only one tensor is in memory at a time
and a checkpoint far larger than memory can be scanned. From a checkpoint: every floating 2-D
`*.weight` tensor except embeddings (looked up, not multiplied), and the experts sites the loaded
model would have (fused 3-D tensors, or per-expert matrices merged). GPT-2's Conv1D leaves
(`c_attn`/`c_fc`/`c_proj`) store [in, out], so their reduction axis is 0.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from qtransform.checkpoints.shards import TensorFiles
from qtransform.core.sites import (
    EXPERT_PARAMS,
    LINEAR_KINDS,
    ROUTER_ROLE,
    Site,
    discover_sites,
    is_router_path,
    layer_index,
    role_of,
)
from qtransform.models import is_quantized_folder, load_model

GPT2_CONV1D_LEAVES = ("c_attn", "c_fc", "c_proj")
_FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_ROLE_ORDER = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "fc1", "fc2", "router",
               "experts.gate_up", "experts.up", "experts.down", "other", "lm_head")


@dataclass(frozen=True)
class WeightRef:
    """One weight to scan: its site and a loader, so that only one tensor is in memory at a time."""

    site: Site
    load: Callable[[], torch.Tensor]


def module_weights(model: nn.Module) -> list[WeightRef]:
    """Every Linear-like site of a model (the site table's), in module order."""
    modules = dict(model.named_modules())
    refs = []
    for site in discover_sites(model).values():
        weight = getattr(modules[site.module_name], site.param or "weight", None)
        if site.kind in LINEAR_KINDS and isinstance(weight, torch.Tensor):
            refs.append(WeightRef(site, weight.detach))
    return refs


def is_embedding(name: str) -> bool:
    """Embedding tables (token, position, type): looked up, never multiplied."""
    leaf = name.rsplit(".", 1)[-1]
    return "embed" in leaf or leaf in ("wte", "wpe")


_PER_EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\."
                             r"(?P<leaf>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PER_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                    "down_proj": "down", "w2": "down"}


def moe_module_name(name: str) -> str:
    """A checkpoint's MoE module path as transformers 5 names the module (Mixtral checkpoints
    call the MoE block `block_sparse_moe`; the model's module is `mlp`)."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def checkpoint_weights(path: str | os.PathLike[str]) -> list[WeightRef]:
    """Linear-like weights of a safetensors checkpoint, read lazily one tensor at a time.

    Mixture-of-experts checkpoints give the sites the loaded model has: fused 3-D expert tensors
    (`...experts.gate_up_proj`, as a transformers 5 state dict holds them, [E, out, in]) are
    experts sites as they are; per-expert 2-D tensors (`...experts.<e>.gate_proj.weight`, Mixtral's
    `w1`/`w3`/`w2`, the layout `save_pretrained` and hub checkpoints use) are merged as
    transformers merges them on loading: `gate_up_proj` [E, 2I, H] (each expert's gate rows, then
    its up rows) and `down_proj` [E, H, I]. A `gate` (or `router`, `shared_expert_gate`) beside an
    `experts` module is a router (`is_router_path`)."""
    plain: list[tuple[Path, str, tuple[int, ...]]] = []
    fused: list[tuple[Path, str, tuple[int, ...]]] = []
    per_expert: dict[str, dict[int, dict[str, tuple[Path, str, tuple[int, ...]]]]] = {}
    for file in TensorFiles(path).shards:
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                info = fh.get_slice(key)
                shape = tuple(info.get_shape())
                if info.get_dtype() not in _FLOAT_DTYPES:
                    continue
                found = _PER_EXPERT_KEY.match(key)
                if found and len(shape) == 2:
                    module = moe_module_name(found["module"])
                    parts = per_expert.setdefault(module, {}).setdefault(int(found["expert"]), {})
                    parts[_PER_EXPERT_PART[found["leaf"]]] = (file, key, shape)
                elif len(shape) == 3 and key.rsplit(".", 1)[-1] in EXPERT_PARAMS:
                    fused.append((file, key, shape))
                elif key.endswith(".weight") and len(shape) == 2 and not is_embedding(key[: -len(".weight")]):
                    plain.append((file, key, shape))
    refs = [_merged_experts(module, experts, plain) for module, experts in per_expert.items()]
    refs = [ref for group in refs for ref in group]
    experts_modules = {moe_module_name(key).rsplit(".", 1)[0] for _, key, _ in fused} | set(per_expert)
    for file, key, shape in fused:
        name = moe_module_name(key)
        refs.append(WeightRef(Site(name=name, cls_name="Experts", kind="experts", layer=layer_index(name),
                                   role=EXPERT_PARAMS[name.rsplit(".", 1)[-1]], weight_shape=shape,
                                   param=name.rsplit(".", 1)[-1]), _loader(file, key)))
    for file, key, shape in plain:
        name = moe_module_name(key[: -len(".weight")])
        kind = "conv1d" if name.rsplit(".", 1)[-1] in GPT2_CONV1D_LEAVES else "linear"
        router = is_router_path(name, experts_modules)
        site = Site(
            name=name, cls_name="Router" if router else "Conv1D" if kind == "conv1d" else "Linear",
            kind=kind, layer=layer_index(name), role=ROUTER_ROLE if router else role_of(name, kind),
            weight_shape=shape, weight_transposed=kind == "conv1d",
        )
        refs.append(WeightRef(site, _loader(file, key)))
    return sorted(refs, key=_site_order)


def _merged_experts(module: str, experts: dict[int, dict[str, tuple[Path, str, tuple[int, ...]]]],
                    plain: list[tuple[Path, str, tuple[int, ...]]]) -> list[WeightRef]:
    """The fused experts sites of one module's per-expert tensors; when the set is not complete
    (an expert or a matrix missing) the tensors stay separate 2-D sites (appended to `plain`)."""
    count = len(experts)
    layout = set(experts.get(0, {}))
    if (sorted(experts) != list(range(count)) or any(set(p) != layout for p in experts.values())
            or not {"up", "down"} <= layout):
        plain.extend(entry for parts in experts.values() for entry in parts.values())
        return []
    refs = []
    up = ["gate", "up"] if "gate" in layout else ["up"]
    for param, pieces in (("gate_up_proj" if len(up) == 2 else "up_proj", up), ("down_proj", ["down"])):
        entries = [[experts[e][p] for p in pieces] for e in range(count)]
        rows = sum(entry[2][0] for entry in entries[0])
        shape = (count, rows, entries[0][0][2][1])
        name = f"{module}.{param}"
        refs.append(WeightRef(Site(name=name, cls_name="Experts", kind="experts", layer=layer_index(name),
                                   role=EXPERT_PARAMS[param], weight_shape=shape, param=param),
                              _stacked_loader(entries)))
    return refs


def _stacked_loader(entries: list[list[tuple[Path, str, tuple[int, ...]]]]) -> Callable[[], torch.Tensor]:
    """Each expert's matrices concatenated along the output rows, experts stacked on axis 0."""
    def load() -> torch.Tensor:
        return torch.stack([torch.cat([_loader(file, key)() for file, key, _ in parts]) for parts in entries])

    return load


def _loader(file: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        # Opened per tensor: a long-lived handle keeps every page it has read mapped (and counted
        # in RSS); reopening bounds memory by the current tensor for the price of a header parse.
        with safe_open(file, framework="pt") as fh:
            return fh.get_tensor(key)

    return load


def _site_order(ref: WeightRef) -> tuple:
    site = ref.site
    role = _ROLE_ORDER.index(site.role) if site.role in _ROLE_ORDER else len(_ROLE_ORDER)
    return (site.layer is None, site.layer or 0, role, site.name)


def weight_refs(source: nn.Module | str | os.PathLike[str]) -> list[WeightRef]:
    """The weights of a module, or of a safetensors file / folder."""
    if isinstance(source, nn.Module):
        return module_weights(source)
    if is_quantized_folder(source):  # packed tensors: read them through our decompression
        return module_weights(load_model(source))
    return checkpoint_weights(source)


def source_label(source: nn.Module | str | os.PathLike[str]) -> str:
    return type(source).__name__ if isinstance(source, nn.Module) else str(source)
