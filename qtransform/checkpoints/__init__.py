"""Quantized checkpoint formats, one home each: compressed-tensors (`compressed_tensors.py`) and
ModelOpt (`modelopt.py`) each hold their names, their layouts (stored tensors and decoding, one
row per scheme) and the mapping between their schemes and qtransform's quantize rules in both
directions; what they share is beside them: the target/ignore matchers (`matching.py`), the
pack/unpack pairs (`packing.py`), the one safetensors reader (`shards.py`), the format-neutral
description (`description.py`), opening a folder (`reader.py`), its policy (`policy.py`) and
online rotations (`rotations.py`). The presets, `load_model` and `export_checkpoint` all read
the formats from here (docs/export.md, docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qtransform.checkpoints.description import Checkpoint
from qtransform.checkpoints.policy import describe, policy
from qtransform.checkpoints.reader import FORMATS, MARKERS, decompress, detect
from qtransform.checkpoints.rotations import bind

ATTRIBUTE = "_qtransform_checkpoint"  # where load_model keeps the Checkpoint on the model


def bind_rotations(checkpoint: Checkpoint, modules: Iterable[tuple[str, Any]]) -> None:
    """Each rotation group's modules in the model (`checkpoint.rotated`), checked."""
    checkpoint.rotated = bind(checkpoint.rotations, modules)


__all__ = ["ATTRIBUTE", "FORMATS", "MARKERS", "Checkpoint", "bind_rotations", "decompress", "describe", "detect",
           "policy"]
