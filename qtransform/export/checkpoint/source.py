"""The full-precision weight a checkpoint quantizes: the parameter itself, rotated where the
rotate pass rotates it (W·R, what the fake quantizer sees), with a PEFT LoRA adapter merged in
(as PEFT's `merge_and_unload` adds it, rotated with W unless the adapters see the rotated input:
`core.lora.dense_weight`'s order), computed when the writer reaches it and never written into
the model."""

from __future__ import annotations

import torch
from torch import Tensor

from qtransform.core.lora import deltas, input_rotation, merge
from qtransform.export.checkpoint.collect import LinearExport


def source_weight(entry: LinearExport) -> Tensor:
    """The weight of `entry` as its checkpoint starts from (rotation and merged LoRA included)."""
    weight = entry.module.weight.detach()
    rotation = entry.rotation
    with torch.no_grad():
        if rotation is not None:
            weight = rotation.rotate_weight(weight)
        if entry.lora is None or entry.lora.merged:  # PEFT's merge already put s B A into W
            return weight
        layer_deltas = deltas(entry.lora)
        if rotation is not None and getattr(input_rotation(entry.module), "lora", "unrotated") == "unrotated":
            layer_deltas = [rotation.rotate_weight(d) for d in layer_deltas]
        return merge(weight, layer_deltas)
