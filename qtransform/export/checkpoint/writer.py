"""Safetensors files written one tensor at a time, sharded with an index past a size limit.

Every tensor's name, dtype and shape is known before any is computed (`Entry`), so each shard's
header is written first and the tensors follow as they are produced: the writer holds one entry's
tensors at a time, never the state dict. The file format (an 8-byte little-endian header length,
a JSON header of dtype / shape / data_offsets, the raw little-endian bytes) is written here, not
by the safetensors package, which wants every tensor of a file in memory at once.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qtransform.errors import UserError

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
DEFAULT_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Spec:
    """A tensor to be written: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Entry:
    """Tensors computed together (a Linear's packed weight and its scales), by `make` when the
    writer reaches them, in the order of `specs`."""

    specs: tuple[Spec, ...]
    make: Callable[[], dict[str, Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def shard_size(limit: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a string such as "5GB" / "500MiB"."""
    if isinstance(limit, int) and not isinstance(limit, bool):
        value = limit
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(limit), re.IGNORECASE)
        if match is None:
            raise UserError(f"max_shard_size {limit!r}: give bytes as an int or a size such as "
                            "'5GB' or '500MiB'")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if value < 1:
        raise UserError(f"max_shard_size {limit!r}: must be at least 1 byte")
    return value


def plan_shards(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Entries in order, a new shard whenever the next entry would pass `limit` (an entry larger
    than the limit gets a shard of its own, as transformers does)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _header(entries: list[Entry]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        for spec in entry.specs:
            header[spec.name] = {"dtype": DTYPES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % 8)  # the data starts 8-byte aligned


def _write_tensor(fh, spec: Spec, tensor: Tensor) -> None:
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise AssertionError(f"{spec.name}: planned {spec.dtype} {list(spec.shape)}, got "
                             f"{tensor.dtype} {list(tensor.shape)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    fh.write(flat.view(torch.uint8).numpy().data if flat.numel() else b"")


def write_file(path: Path, entries: list[Entry]) -> None:
    """One safetensors file: the header, then each entry's tensors as `make` produces them."""
    header = _header(entries)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for entry in entries:
            tensors = entry.make()
            for spec in entry.specs:
                _write_tensor(fh, spec, tensors[spec.name])
            del tensors


def write_shards(folder: Path, entries: Iterable[Entry], max_shard_size: int | str) -> list[str]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` and
    `model.safetensors.index.json` when the tensors pass `max_shard_size`; the file names."""
    entries = list(entries)
    names = [s.name for e in entries for s in e.specs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise AssertionError(f"tensor {dup} planned twice")
    shards = plan_shards(entries, shard_size(max_shard_size))
    if len(shards) == 1:
        write_file(folder / "model.safetensors", shards[0])
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards, strict=True):
        write_file(folder / file, shard)
        weight_map.update({s.name: file for e in shard for s in e.specs})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*files, "model.safetensors.index.json"]
