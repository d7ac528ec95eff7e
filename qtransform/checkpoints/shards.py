"""Reading a safetensors checkpoint tensor by tensor: the one reader of every checkpoint
qtransform opens (the weight scan lists its tensors, the sequential scan loads one decoder layer
at a time, `load_model` decompresses a quantized folder through it).

A checkpoint is a `.safetensors` file, a folder holding one, or a folder of shards that
`model.safetensors.index.json` lists. Nothing is trusted before it is checked: every file's
header against the file (`check_safetensors`), the index (a weight_map naming files in the
same folder, each present), and the agreement of both (every tensor in exactly one shard, the
shard the index names). Several files without an index are not one model (a model and its
adapter, or two models) and are refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from qtransform.core import io as qio
from qtransform.errors import UserError, missing_source

INDEX_FILE = "model.safetensors.index.json"
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the safetensors library's own limit
SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                     "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                     "F8_E5M2": 1, "F8_E8M0": 1}


def check_safetensors(file: Path) -> None:
    """Validate a safetensors header against the file before any loader trusts it: the header
    length, its JSON, and every tensor's dtype, shape and byte range (in the file, sized right)."""
    qio.check_input_file(file, "safetensors file", limit=None)
    size = file.stat().st_size
    bad = f"{file}: not a valid safetensors file"
    fix = "; the file is truncated or corrupt: re-download or re-save it"
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"{bad} (only {size} bytes){fix}")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise UserError(f"{bad} (header of {n} bytes in a file of {size} bytes){fix}")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{bad} (its header is not JSON){fix}") from None
    if not isinstance(header, dict):
        raise UserError(f"{bad} (its header is not a JSON object){fix}")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(lo, int)
                  and isinstance(hi, int) and 0 <= lo <= hi <= data)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"{bad} (tensor {name!r}: its entry is malformed or points past the "
                            f"end of the file){fix}")
        width = SAFETENSORS_BYTES.get(dtype)
        if width is not None and math.prod(shape) * width != hi - lo:
            raise UserError(f"{bad} (tensor {name!r}: {dtype}{list(shape)} needs "
                            f"{math.prod(shape) * width} bytes, its header says {hi - lo}){fix}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard file map, each file named inside the index's folder."""
    try:
        weight_map = json.loads(qio.read_input_text(index, "checkpoint index"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"{index}: not a safetensors index (no weight_map of file names); "
                        "re-save the checkpoint") from None
    if not names or not all(isinstance(n, str) and n and "/" not in n for n in names):
        raise UserError(f"{index}: its weight_map must name shard files in the same folder")
    return weight_map


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of one checkpoint, headers validated: the file itself, a folder's
    only file, or the shards its index lists."""
    p = Path(path)
    if not p.exists():
        if p.is_symlink():
            raise UserError(f"{p}: a dangling symlink (to {os.readlink(p)!r}); fix the link")
        raise missing_source(str(p), "file or folder (expected a safetensors checkpoint or HF folder)")
    if not p.is_dir():
        if p.suffix != ".safetensors":
            raise UserError(f"{p}: not a .safetensors file")
        check_safetensors(p)
        return [p]
    files = sorted(p.glob("*.safetensors"))
    index = p / INDEX_FILE
    if index.exists() or index.is_symlink():
        files = [p / name for name in sorted(set(_weight_map(index).values()))]
    elif len(files) > 1:
        raise UserError(f"{p}: {len(files)} safetensors files ({', '.join(f.name for f in files[:3])}"
                        f"{', ...' if len(files) > 3 else ''}) but no {INDEX_FILE}: not one sharded "
                        "checkpoint; scan one file, or put each model in its own folder")
    if not files:
        found = ", ".join(sorted(f.name for f in p.iterdir())[:6]) or "nothing"
        raise UserError(f"{p}: no .safetensors files in this folder (found: {found})")
    for file in files:
        check_safetensors(file)
    return files


class TensorFiles:
    """The tensors of one checkpoint (see the module docstring): `files` maps each tensor name to
    the file holding it; `load` reads tensors one file open at a time."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.shards = checkpoint_files(path)
        self.files: dict[str, Path] = {}
        for file in self.shards:
            with safe_open(file, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (not a dict)
                    if name in self.files:
                        raise UserError(f"{self.path}: tensor {name!r} is in two shards "
                                        f"({self.files[name].name}, {file.name}); re-save the checkpoint")
                    self.files[name] = file
        index = self.path / INDEX_FILE
        if self.path.is_dir() and (index.exists() or index.is_symlink()):
            for name, shard in _weight_map(index).items():
                if self.files.get(name) != self.path / shard:
                    where = self.files[name].name if name in self.files else "no shard"
                    raise UserError(f"{index}: maps {name!r} to {shard}, but {where} holds it; "
                                    "the index does not match its shards: re-save the checkpoint")

    def load(self, names: list[str], dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """These tensors, read from their files (converted to `dtype` when given)."""
        missing = [n for n in names if n not in self.files]
        if missing:
            raise UserError(f"{self.path}: the checkpoint has no tensor {missing[0]!r}; is it complete?")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safe_open(file, "pt") as fh:
                for name in group:
                    t = fh.get_tensor(name)
                    out[name] = t if dtype is None else t.to(dtype)
        return out

    def items(self) -> Iterator[tuple[str, Tensor, Path]]:
        """Every tensor with the file that holds it, one file open at a time, in file order."""
        for file in self.shards:
            with safe_open(file, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (not a dict)
                    yield name, fh.get_tensor(name), file
