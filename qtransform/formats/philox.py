"""The uniform stream of stochastic rounding: Philox4x32-10 keyed by a 64-bit seed, counted by
element position.

Element `i` (its row-major linear index in the tensor being quantized, before any blocking,
padding, axis move or chunking) takes word `i % 4` of Philox4x32-10 with counter
`(i // 4 mod 2^32, i // 4 >> 32, 0, 0)` and key `(seed mod 2^32, seed >> 32)`, and
`u = (word >> 8) * 2^-24`, exactly representable in fp32, in [0, 1 - 2^-24]. A draw depends on
(seed, position) only, so thread count, chunking and device cannot change a result, and a GPU
kernel can reproduce it (Philox is what cuRAND and torch's CUDA generator are built on). This is
the torch version, on any device, in int64 arithmetic that never overflows (32x32-bit products
are built from 16-bit halves); qfast.c computes the same words.
"""

from __future__ import annotations

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
MASK32 = 0xFFFFFFFF
ROUNDS = 10


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of m * c for 32-bit m and c (int64 tensors, no overflow)."""
    p_lo = (c & 0xFFFF) * m  # < 2^48
    mid = (p_lo >> 16) + (c >> 16) * m  # < 2^49
    return mid >> 16, ((mid & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def philox4x32(
    ctr: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], key: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 of counters given as four int64 tensors of 32-bit words (Random123's
    definition: ten rounds, the key bumped by the Weyl constants between rounds)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key[0] & MASK32, key[1] & MASK32
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & MASK32, (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def split_seed(seed: int) -> tuple[int, int]:
    """The Philox key of a seed (any int, taken mod 2^64)."""
    seed %= 1 << 64
    return seed & MASK32, seed >> 32


def uniform_at(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """fp32 draws u of the elements at linear `positions` (int64, any shape, on their device)."""
    ctr = positions >> 2
    zero = torch.zeros_like(ctr)
    words = torch.stack(philox4x32((ctr & MASK32, ctr >> 32, zero, zero), split_seed(seed)), -1)
    word = words.gather(-1, (positions & 3).unsqueeze(-1)).squeeze(-1)
    return (word >> 8).to(torch.float32) * 2.0**-24


def positions(shape: tuple[int, ...], dim: int = 0, start: int = 0, length: int | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Row-major linear positions, in a tensor of `shape`, of its slice `start:start+length`
    along `dim` (default: the whole tensor)."""
    if not shape:
        return torch.zeros((), dtype=torch.int64, device=device)
    if length is None:
        length = shape[dim] - start
    pos = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for j in range(len(shape) - 1, -1, -1):
        idx = torch.arange(start, start + length, device=device) if j == dim else torch.arange(
            shape[j], device=device)
        pos = pos + (idx * stride).reshape([-1] + [1] * (len(shape) - 1 - j))
        stride *= shape[j]
    return pos


def seed_from(generator: torch.Generator | None, device: torch.device | str = "cpu") -> int:
    """A 64-bit stream seed from one draw of `generator` (two 32-bit words; the global generator
    when None), so seeded generators keep reproducing their runs."""
    dev = generator.device if generator is not None else device
    w = torch.randint(0, 1 << 32, (2,), generator=generator, device=dev, dtype=torch.int64)
    hi, lo = (int(v) for v in w.cpu())
    return (hi << 32) | lo
