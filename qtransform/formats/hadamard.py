"""Blockwise Walsh-Hadamard rotations: the reference every rotation path computes.

`H_b` is the Sylvester-ordered Walsh-Hadamard matrix of order b (a power of two), scaled by
1/sqrt(b) so that it is orthonormal and symmetric: H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]
/ sqrt(2). A random Hadamard rotation is `D·H_b` with D = diag(signs); sign i of a seed is
+1 when the stochastic-rounding stream's draw `philox.uniform_at(seed, i)` is below 1/2, else
-1 (documented, device independent). `rotate(x, b, signs)` applies it to the last axis, block by
block of b consecutive elements: y = (x * signs) @ H_b per block. Because D·H_b is orthogonal, a
Linear whose input and weight are both rotated along the reduction axis computes the same
product in exact arithmetic: (x·R)(W·R)ᵀ = x·Wᵀ.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qtransform.formats import philox


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ...: the orders a Sylvester Hadamard matrix exists for."""
    return n >= 1 and n & (n - 1) == 0


def hadamard_matrix(b: int, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Tensor:
    """H_b / sqrt(b), Sylvester order, built in float64 and rounded once to `dtype`."""
    if not is_power_of_two(b):
        raise ValueError(f"a Hadamard block size must be a power of two, got {b}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(b)).to(dtype=dtype, device=device)


def random_signs(b: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """The ±1 diagonal of a random Hadamard rotation of order b (float32)."""
    u = philox.uniform_at(seed, torch.arange(b, dtype=torch.int64, device=device))
    return torch.where(u < 0.5, 1.0, -1.0).to(torch.float32)


def rotate(x: Tensor, block_size: int, signs: Tensor | None = None) -> Tensor:
    """x rotated along its last axis, per block of `block_size`: (x * signs) @ H_b per block.

    Computed as a dense matmul in float32 (the reference); the fast transforms elsewhere must
    agree with it to rounding. The last axis must be a multiple of `block_size`.
    """
    n = x.shape[-1]
    if n % block_size:
        raise ValueError(f"axis of {n} is not a multiple of the block size {block_size}")
    dtype = x.dtype
    xb = x.to(torch.float32).reshape(*x.shape[:-1], n // block_size, block_size)
    if signs is not None:
        xb = xb * signs.to(device=x.device, dtype=torch.float32)
    h = hadamard_matrix(block_size, torch.float32, x.device)
    return (xb @ h).reshape(x.shape).to(dtype)
