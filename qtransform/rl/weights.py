"""Rollout weights: the tensors an inference engine needs to run the model as the rollout sees it.

Engines receive weights as a stream of `(Hugging Face name, tensor)` pairs (vLLM's
`load_weights`, TRL's and verl's syncs). `rollout_weights(model)` produces that stream from a
transformed model: every tensor under the base model's own name (PEFT's prefix and `base_layer`
removed, LoRA merged when asked), each site weight as the rollout computes it (fake-quantized
linears, AQN-noised norms at the controller's current step). `rollout_filter(model, pairs)`
applies the same transformation to a stream another system produces (verl's per-tensor
generator, TRL's gathered parameters, `full_tensor()` of a sharded model), so a sharded trainer
gathers exactly as it does today and qtransform never gathers on its own.

One tensor at a time: the extra memory is the tensor being transformed. Only weight-side
transforms travel: fake quantization of inputs or outputs (W4A4) and hardware error act on
activations, which an engine computes itself. The one exception is a KV cache with static
scales: the engine quantizes keys and values itself but takes their scales from what it loads,
so each attention's `k_scale` / `v_scale` follow the stream (in compressed-tensors' names and
layout), and a recalibration (`qtransform.calibrate(model, batches, tensors=["key", "value"])`)
reaches the engine with the next push instead of leaving it at the scales it started with.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from qtransform.core.lora import deltas, dense_weight, lora_layers, lora_mode, unmerge
from qtransform.core.phase import syncing
from qtransform.core.sites import ADAPTER_KEYS, hf_name
from qtransform.core.tracing import module_graph
from qtransform.errors import UserError
from qtransform.passes import AQNNoisePass, FakeQuantize, FakeQuantPass, RotatePass

# what changes a weight (a rotated site sends W·R: the engine rotates its input, docs/rotations.md)
_WEIGHT_PASSES = (RotatePass.name, FakeQuantPass.name, AQNNoisePass.name)


def _weight_chains(model: nn.Module) -> dict[str, list[nn.Module]]:
    """HF weight name -> the inserted modules its site applies to the weight, in order."""
    chains: dict[str, list[nn.Module]] = {}
    for name, module in model.named_modules():
        state = module_graph(module)
        if state is None:
            continue
        for ins in state.insertions:
            if ins.point != "weight" or ins.pass_name not in _WEIGHT_PASSES:
                continue
            chain = chains.setdefault(hf_name(f"{name}.{_weight_param(module, ins.site)}"), [])
            chain.append(module._modules[ins.module_path.rsplit(".", 1)[-1]])
    return chains


def _weight_param(module: nn.Module, site: str) -> str:
    """The parameter a weight-point insertion acts on: `weight`, or for a fused experts site
    (`...experts.gate_up_proj`) the 3-D parameter the site is named after."""
    leaf = site.rsplit(".", 1)[-1]
    return leaf if isinstance(module._parameters.get(leaf), nn.Parameter) else "weight"


def _apply(chain: list[nn.Module], tensor: Tensor) -> Tensor:
    """What the site's forward does to its weight (a fake quantizer switched off passes it)."""
    for module in chain:
        if not isinstance(module, FakeQuantize):
            tensor = module(tensor)
        elif module.enabled:
            tensor = module.quantize(tensor)
    return tensor


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (whose names start with `module.`)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


_ADAPTER = re.compile(rf"(?:^|\.)(?:{'|'.join(ADAPTER_KEYS)})\.|\.original_module\.")


def _is_adapter(name: str) -> bool:
    return _ADAPTER.search(name) is not None


def _lora_by_weight(model: nn.Module) -> dict[str, nn.Module]:
    """HF weight name of each LoRA layer's base weight -> the layer (bound to its semantics)."""
    return {hf_name(f"{name}.base_layer.weight"): layer for name, layer in lora_layers(model)}


def _check_lora_stream(layer: nn.Module, key: str, merge_lora: bool) -> None:
    if not merge_lora and lora_mode(layer.base_layer) == "merged":
        raise UserError(f"{key}: its quantize rule has lora='merged' (the trainer computes "
                        "quant(W + s B A)), so its rollout weight is the merged one: an engine "
                        "that applies the adapters itself cannot run it; use merge_lora=True")


def rollout_filter(model: nn.Module, pairs: Iterable[tuple[str, Tensor]], *,
                   merge_lora: bool = True) -> Iterator[tuple[str, Tensor]]:
    """Transform a stream of `(name, tensor)` pairs as the rollout of `model` sees them.

    Names may be the base model's or PEFT's (`base_model.model.…base_layer.weight`); they come
    out as the base model's. Adapter tensors (`lora_A`, `lora_B`, ...) are dropped. The base
    weight of a LoRA layer leaves as its rollout weight (`core.lora.dense_weight`: quant(W) +
    s B A, or quant(W + s B A) with the rule's lora="merged"), computed with the model's own
    adapters from the W the stream carries; where PEFT has merged the adapters at this moment
    (TRL's sync and verl's `lora.merge=True` stream W + s B A), W is what PEFT's unmerge will
    leave, so the stream equals the trainer's model after the sync bit for bit. With
    `merge_lora=False` the base weight leaves quantized alone, for an engine that applies the
    adapters itself (verl without merge; the adapters travel on their own, untouched).
    """
    model = _unwrapped(model)
    chains = _weight_chains(model)
    layers = _lora_by_weight(model)
    with torch.no_grad(), syncing():
        for name, tensor in pairs:
            if _is_adapter(name):
                continue
            key = hf_name(name)
            layer = layers.get(key)
            if layer is not None:
                _check_lora_stream(layer, key, merge_lora)
                base = unmerge(tensor, deltas(layer)) if layer.merged else tensor
                if merge_lora:
                    yield key, dense_weight(layer, base)
                    continue
                tensor = base
            chain = chains.get(key)
            yield key, (_apply(chain, tensor) if chain else tensor)
        yield from kv_scale_pairs(model)


KV_NAMES = {"key": "k_scale", "value": "v_scale"}  # compressed-tensors' names, which vLLM loads


def kv_scale_pairs(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Each attention's static KV scales as an engine loads them: `<attention>.k_scale` /
    `v_scale`, [1] or [heads, 1, 1], in the model's dtype (what `export_checkpoint` stores).
    Fixed and dynamic scales do not travel (the engine has its own)."""
    for name, module in _unwrapped(model).named_modules():
        state = module_graph(module)
        if state is None or not state.attention:
            continue
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        for ins in state.insertions:
            child = module._modules.get(ins.module_path.rsplit(".", 1)[-1])
            if ins.point not in KV_NAMES or ins.pass_name != FakeQuantPass.name or child is None:
                continue
            if child.quantizers()[0].global_scale != "static":
                continue
            scale = child.stored_scale(dtype)
            shape = (1,) if isinstance(child, FakeQuantize) else (scale.numel(), 1, 1)
            yield f"{hf_name(name)}.{KV_NAMES[ins.point]}", scale.reshape(shape)


def _own_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The model's state, one tensor at a time (a sharded tensor gathered alone)."""
    for name, tensor in model.state_dict().items():
        if not _is_adapter(name):
            yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor)


def rollout_weights(model: nn.Module, *, merge_lora: bool = True) -> Iterator[tuple[str, Tensor]]:
    """`(HF name, tensor)` pairs of `model` as its rollout sees them, one tensor at a time.

    Loading them into the plain original architecture (`load_state_dict`, or an engine's
    `load_weights`) reproduces the transformed model's rollout outputs bit for bit for
    weight-side transforms, LoRA included (a LoRA layer's rollout computes with the dense weight
    it sends: `core.lora`). With `merge_lora=False` LoRA layers send their quantized base weight
    alone, for an engine that applies the adapters itself (they are
    `peft.get_peft_model_state_dict(model)`, in full precision; lora="beside" only).

    On a model sharded with FSDP2 every rank must iterate the pairs in step: each DTensor is
    gathered (`full_tensor()`, a collective) when its pair is produced, and only it, so the
    extra memory is one full tensor and its transformed copy. A DDP wrapper is looked through.
    """
    model = _unwrapped(model)
    yield from rollout_filter(model, _own_tensors(model), merge_lora=merge_lora)
