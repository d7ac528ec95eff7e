"""The interface every checkpoint format's writer declares, and the registry `export_checkpoint`
picks from: a new format is one module implementing `FormatWriter` (beside its vocabulary in
`qtransform.checkpoints`) and one entry in `WRITERS`; a new scheme of a format is one row of its
layouts there (docs/architecture.md counts the files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from qtransform.export.checkpoint import compressed_tensors, modelopt
from qtransform.export.checkpoint.collect import Collected, LinearExport
from qtransform.export.checkpoint.kv import KVCache
from qtransform.export.checkpoint.writer import Entry


class FormatWriter(Protocol):
    """What a checkpoint format's writer module provides (module-level names)."""

    NAME: str  # the format's name, as `export_checkpoint(format=...)` takes it
    ROTATIONS: bool  # whether the format stores online rotations (compressed-tensors' transform_config)
    KV_ONLY: bool  # whether a checkpoint may quantize its KV cache alone (no quantized Linear)

    def schemes(self, collected: Collected) -> tuple[dict[str, Any], list[str]]:
        """Each quantized Linear's scheme, and one reason per thing the format cannot express."""

    def kv_cache(self, kv: KVCache) -> tuple[Any, list[str]]:
        """The format's KV-cache scheme of the model's keys and values, or why it has none."""

    def quantization_config(self, collected: Collected, found: dict[str, Any], kv: Any,
                            transform_config: dict[str, Any] | None) -> dict[str, Any]:
        """config.json's quantization_config (`kv`: the KV-cache scheme, or None)."""

    def write_extra(self, folder: Path, collected: Collected, found: dict[str, Any], kv: Any) -> None:
        """Files beside config.json and the weights (ModelOpt's hf_quant_config.json)."""

    def linear_entry(self, entry: LinearExport, scheme: Any) -> Entry:
        """The tensors that replace one quantized Linear's weight."""

    def kv_entries(self, kv: KVCache, scheme: Any) -> list[Entry]:
        """The stored scales of every attention's keys and values."""


WRITERS: dict[str, FormatWriter] = {w.NAME: w for w in (compressed_tensors, modelopt)}
