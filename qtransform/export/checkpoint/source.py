"""The full-precision weight a checkpoint quantizes: the parameter itself, rotated where the
rotate pass rotates it (W·R, what the fake quantizer sees), with a PEFT LoRA adapter merged in
(as PEFT's `merge_and_unload` adds it, rotated with W unless the adapters see the rotated input:
`core.lora.dense_weight`'s order), computed when the writer reaches it and never written into
the model. A weight stored rotated (rotate rule weight "stored", an opened rotated checkpoint)
holds W·R already and is taken as it is, so a re-export writes the same bytes. Likewise a
static input scale: computed from its calibrated amax, or an opened checkpoint's stored scale
written back as it is."""

from __future__ import annotations

import torch
from torch import Tensor

from qtransform.core.lora import apply_chain, delta_rotations, deltas, merge
from qtransform.core.scales import quantizer_weight
from qtransform.export.checkpoint.collect import LinearExport
from qtransform.formats.stored import scale_of, stored_input_scale


def source_weight(entry: LinearExport) -> Tensor:
    """The weight of `entry` as its checkpoint starts from (rotation and merged LoRA included)."""
    rotation = entry.rotation
    rotated = rotation is not None and rotation.enabled and not getattr(rotation, "stored_weight", False)
    weight = quantizer_weight(entry.module.weight, rotation.operand if rotated else None,
                              rotation.axis if rotated else -1)
    with torch.no_grad():
        if entry.lora is None or entry.lora.merged:  # PEFT's merge already put s B A into W
            return weight
        rotations = delta_rotations(entry.module)
        return merge(weight, [apply_chain(rotations, d) for d in deltas(entry.lora)])


def source_input_scale(entry: LinearExport) -> tuple[Tensor, Tensor | None]:
    """(scale, NVFP4 tensor scale) of `entry`'s static input scale, as the format stores it."""
    fq = entry.input
    assert fq is not None and fq.static_scale is not None
    static, dtype = fq.static_scale, entry.module.weight.dtype
    if static.stored:
        return stored_input_scale(fq.config, static.scale, dtype)
    return scale_of(fq.config, static.amax, dtype)
