"""The full-precision weight a checkpoint quantizes: the parameter itself, or with a PEFT LoRA
adapter merged in (W + s B A, added as PEFT's `merge_and_unload` adds it), computed when the
writer reaches it and never written into the model."""

from __future__ import annotations

import torch
from torch import Tensor

from qtransform.core.lora import deltas, merge
from qtransform.export.checkpoint.collect import LinearExport


def source_weight(entry: LinearExport) -> Tensor:
    """The weight of `entry` as its checkpoint starts from (merged LoRA included)."""
    weight = entry.module.weight.detach()
    if entry.lora is None or entry.lora.merged:  # PEFT's merge already put s B A into W
        return weight
    with torch.no_grad():
        return merge(weight, deltas(entry.lora))
