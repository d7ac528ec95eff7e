"""The one answer to "has this tensor changed since I last looked?", for caches of derived values.

Autograd's version counter misses writes through `.data` (PEFT's merge, `p.data.copy_(...)`),
and a storage pointer says nothing once FSDP2 all-gathers into reused storage. The key therefore
includes the content: a CRC-32 of the bytes on CPU (one read, about a quarter of the cost of
quantizing the tensor), a position-weighted integer checksum on other devices (two reductions;
any single changed or swapped element changes it).

The CPU bytes are read through a ctypes view of the tensor's memory, not `Tensor.numpy()`: a
numpy view marks the storage as not resizable for the rest of its life, and FSDP2 frees and
re-allocates the storage of its unsharded parameters by resizing it.
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Hashable

import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(x: torch.Tensor) -> int:
    flat = x.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    if flat.device.type == "cpu":
        raw = (ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
        return zlib.crc32(raw)  # `flat` stays referenced, so its memory lives through the read
    ints = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
    rows = ints.reshape(-1, flat.shape[-1]) if x.dim() else ints.reshape(1, -1)
    weights_r = torch.arange(1, rows.shape[0] + 1, device=rows.device, dtype=torch.int64)
    weights_c = torch.arange(1, rows.shape[1] + 1, device=rows.device, dtype=torch.int64)
    return int((rows.sum(1) * weights_r).sum() + (rows.sum(0) * weights_c).sum())


def content_key(x: torch.Tensor) -> Hashable:
    """A key that changes whenever `x`'s dtype, device, shape or any element changes."""
    return (x.dtype, x.device, tuple(x.shape), _checksum(x))
