"""The one answer to "has this tensor changed since I last looked?", for caches of derived values
(the fake-quant weight cache, the instrument pass's weight taps).

Reading every byte of every weight at every forward costs more than a decode step's matmuls (a
decode step reads each weight once), so a `Watch` checks in three tiers, from free to thorough:

1. identity: the same tensor object, data pointer, storage offset, shape, strides, dtype, device
   and autograd version counter. Every write through torch to the tensor or to a view of it
   bumps the counter (optimizer steps, `load_state_dict`, `copy_` under no_grad, `nn.init`), and
   a new storage (`p.data = t`, a replaced Parameter, FSDP2 or accelerate putting a new tensor
   in the slot) changes the pointer or the object.
2. a sample: `SAMPLES` elements evenly spaced through the tensor (CPU), compared bit for bit
   (about a microsecond; one element per row, read through torch, cost 3 % of a prefill
   forward). On a GPU the sampled elements are copied to the host (one small synchronizing
   copy instead of a checksum of every byte).
   The counter misses in-place writes through `.data` (PEFT's `merge_and_unload`,
   `p.data.copy_(...)`) and through other aliases (numpy views); such a write is seen here when
   it changes a sampled element, which any write that changes every element of a 1/SAMPLES
   run of the tensor does (a merge of a trained adapter changes every row, a copy of other
   weights every element).
3. the content: an xxh3 hash of every byte on CPU (5-10 GB/s, most of a decode step's time on
   a small model; a position-weighted integer checksum on other devices), taken when tier 1 or
   2 saw a difference (so a new tensor with the same bytes, as accelerate's offload hooks give,
   costs no re-quantization), at the first call after `Watch.recheck()` (the owning module's
   `train()` / `eval()`), and at every call of check "content" (FSDP-managed modules). A bumped
   version counter on the same storage (an optimizer step) is "changed" without a hash: the
   caller recomputes from the current bytes anyway.

With check "identity" (inside a rollout block: generate's decode steps) tier 2 runs only at the
first call after `recheck()` (the block's entry).

The CPU bytes are read through a ctypes view of the tensor's memory, not `Tensor.numpy()`: a
numpy view marks the storage as not resizable for the rest of its life, and FSDP2 frees and
re-allocates the storage of its unsharded parameters by resizing it.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Literal

import numpy as np
import torch
import xxhash

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SAMPLES = 16  # elements compared by tier 2, evenly spaced

Check = Literal["identity", "sample", "content"]

_epoch = 0
_bytes_hashed = 0


def recheck() -> None:
    """Make every watch compare its sample at its next call, also with check "identity" (a
    rollout block's entry: a whole-row write made before it through `.data` is seen by the
    block's first forward)."""
    global _epoch
    _epoch += 1


def epoch() -> int:
    """The `recheck()` count: a rollout block's entry moves it."""
    return _epoch


def bytes_hashed() -> int:
    """Bytes the content hash has read in this process: how a test sees that a forward whose
    weights did not change reads none of them."""
    return _bytes_hashed


def content_hash(x: torch.Tensor) -> int:
    """A hash of `x`'s elements in order (all of its bytes on CPU)."""
    global _bytes_hashed
    flat = x.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    _bytes_hashed += flat.numel() * flat.element_size()
    if flat.device.type == "cpu":
        raw = (ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
        return xxhash.xxh3_64_intdigest(raw)  # `flat` stays referenced through the read
    ints = flat.view(_INT_VIEW[flat.element_size()])  # summed as int64 inside the reductions:
    rows = ints.reshape(-1, x.shape[-1]) if x.dim() else ints.reshape(1, -1)  # no int64 copy
    weights_r = torch.arange(1, rows.shape[0] + 1, device=rows.device, dtype=torch.int64)
    weights_c = torch.arange(1, rows.shape[1] + 1, device=rows.device, dtype=torch.int64)
    return int((rows.sum(1, dtype=torch.int64) * weights_r).sum()
               + (rows.sum(0, dtype=torch.int64) * weights_c).sum())


def sample_stride(numel: int) -> int:
    """The distance between sampled elements: every run of this many consecutive elements holds
    one, and there are at most `SAMPLES` of them."""
    return max(1, -(-numel // SAMPLES))


class Watch:
    """Remembers the last tensor seen by one cache and says whether the next one differs."""

    def __init__(self) -> None:
        self.forget()

    def __getstate__(self) -> dict:
        return {}  # a copy (deepcopy, pickle) has seen nothing: its tensors are other objects

    def __setstate__(self, state: dict) -> None:
        self.forget()

    def forget(self) -> None:
        """Nothing seen: the next call says "changed"."""
        self._ref: weakref.ref | None = None
        self._ident: tuple | None = None
        self._digest: tuple | None = None
        self._full = True  # hash every byte at the next call
        self._epoch = -1  # the `recheck()` count at the last sample
        self._sample: bytes | None = None
        self._where: tuple | None = None  # (address, numel, element size) of `_view`
        self._view: np.ndarray | None = None

    def recheck(self) -> None:
        """Hash every byte at the next call (the owner's `train()` / `eval()`)."""
        self._full = True

    def changed(self, x: torch.Tensor, check: Check = "sample") -> bool:
        """Whether `x` differs from the tensor of the previous call (True at the first call).
        `check` is the most done while `x` looks the same (tier 1 holds); "identity" still
        samples once after each `recheck()`."""
        version = None if x.is_inference() else x._version  # inference tensors keep none
        ident = (x.data_ptr(), x.storage_offset(), version, x.shape, x.stride(), x.dtype, x.device)
        same_tensor = check != "content" and self._ref is not None and self._ref() is x
        if same_tensor and not self._full and ident == self._ident:
            if check == "identity" and self._epoch == _epoch:
                return False
            self._epoch = _epoch
            # tier 1 held, so `_view` (set by `_take` for this very tensor) still points at it
            sample = self._view.tobytes() if self._view is not None else self._take(x)
            if sample is not None and sample == self._sample:
                return False
        elif (same_tensor and self._ident is not None
                and ident[:2] + ident[3:] == self._ident[:2] + self._ident[3:]
                and ident[2] != self._ident[2]):
            # written through torch in place (an optimizer step): the caller recomputes from
            # the current bytes, so hashing them first would only cost a read
            self._ident, self._digest, self._full = ident, None, False
            self._epoch, self._sample = _epoch, self._take(x)
            return True
        digest = (x.dtype, x.device, tuple(x.shape), content_hash(x))
        changed = digest != self._digest
        self._ref, self._ident, self._digest = weakref.ref(x), ident, digest
        sample = self._take(x)
        self._full, self._epoch, self._sample = False, _epoch, sample
        return changed

    def _take(self, x: torch.Tensor) -> bytes | None:
        """The sampled elements' bytes (a bitwise comparison: -0.0 is not 0.0, NaN is NaN);
        None where there is no cheap sample (non-contiguous, empty, meta). On CPU read through a
        numpy view of the raw memory made once per storage: one call, no torch dispatch. It is
        read only after tier 1 held, i.e. while `x` is alive at that same address."""
        n = x.numel()
        if n == 0 or not x.is_contiguous() or x.device.type != "cpu":
            self._where = self._view = None  # `changed` reads `_view` only for this tensor
            if n == 0 or not x.is_contiguous() or x.device.type == "meta":
                return None
            if x.element_size() not in _INT_VIEW:  # a GPU: the sampled elements copied over
                return None  # (one small sync), far cheaper than a checksum of every byte
            picked = x.detach().reshape(-1)[::sample_stride(n)].view(_INT_VIEW[x.element_size()])
            return picked.cpu().numpy().tobytes()
        where = (x.data_ptr(), n, x.element_size())
        if self._where != where:
            ptr, n, size = where
            raw = np.frombuffer((ctypes.c_char * (n * size)).from_address(ptr), dtype=f"V{size}")
            self._where, self._view = where, raw[::sample_stride(n)]
        return self._view.tobytes()
