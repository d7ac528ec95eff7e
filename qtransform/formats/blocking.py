"""Blocking: cut a tensor into scale blocks and put it back.

A block runs along one axis (zero-padded per row, so blocks never straddle rows) or is a 2D tile
over the last two dims (zero-padded per tile). The padding only adds zeros, which change no block
amax; it is cut off again by `from_blocks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor of `shape` maps onto a `[n_blocks, block_numel]` block tensor."""

    shape: tuple[int, ...]
    axis: int  # normalized blocking axis (tiles: ndim - 1)
    block: int  # 1D block length (tiles: 0)
    tile: tuple[int, int] | None = None

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Shape of a per-block tensor: the blocked dim(s) replaced by their block counts."""
        s = list(self.shape)
        if self.tile:
            s[-2] = math.ceil(s[-2] / self.tile[0])
            s[-1] = math.ceil(s[-1] / self.tile[1])
        else:
            s[self.axis] = math.ceil(s[self.axis] / self.block)
        return tuple(s)


def make_layout(
    shape: tuple[int, ...], axis: int, block: int, tile: tuple[int, int] | None
) -> BlockLayout:
    """Validate the axis / tile against the tensor's rank and build its layout.

    A block (or tile side) longer than the dim it runs along is cut to that dim's length: the
    zero padding it would add changes no amax and is dropped again, so the results are the same,
    and a huge block size costs no memory (a group of 10^9 padded every row to 10^9 elements).
    """
    ndim = len(shape)
    if tile is not None:
        if ndim < 2:
            raise ValueError(f"block_shape={tile} needs a tensor with >= 2 dims, got shape {shape}")
        return BlockLayout(tuple(shape), ndim - 1, 0,
                           (min(tile[0], max(shape[-2], 1)), min(tile[1], max(shape[-1], 1))))
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of shape {tuple(shape)}")
    return BlockLayout(tuple(shape), axis % ndim, min(block, max(shape[axis], 1)))


def to_blocks(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """`[n_blocks, block_numel]` view/copy of x, zero-padded per row (or per tile)."""
    if layout.tile:
        r, c = layout.tile
        m, n = x.shape[-2:]
        lead = x.shape[:-2]
        xp = F.pad(x, (0, (-n) % c, 0, (-m) % r))
        mb, nb = xp.shape[-2] // r, xp.shape[-1] // c
        xp = xp.reshape(*lead, mb, r, nb, c).transpose(-3, -2)
        return xp.reshape(-1, r * c)
    b = layout.block
    xm = x.movedim(layout.axis, -1)
    xm = F.pad(xm, (0, (-xm.shape[-1]) % b))
    return xm.reshape(-1, b)


def from_blocks(blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Inverse of `to_blocks`: back to `layout.shape`, padding dropped."""
    shape = layout.shape
    if layout.tile:
        r, c = layout.tile
        lead, (m, n) = shape[:-2], shape[-2:]
        mb, nb = layout.grid_shape[-2:]
        y = blocks.reshape(*lead, mb, nb, r, c).transpose(-3, -2)
        return y.reshape(*lead, mb * r, nb * c)[..., :m, :n]
    moved = list(shape)
    n = moved.pop(layout.axis)
    y = blocks.reshape(*moved, math.ceil(n / layout.block) * layout.block)[..., :n]
    return y.movedim(-1, layout.axis)


def per_block(values: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Reshape a `[n_blocks]` tensor to `layout.grid_shape` (block dim at the blocked axis)."""
    if layout.tile:
        return values.reshape(layout.grid_shape)
    moved = list(layout.grid_shape)
    nb = moved.pop(layout.axis)
    return values.reshape(*moved, nb).movedim(-1, layout.axis)


@dataclass
class BlockQuant:
    """What a format family computes for a `[n_blocks, block_numel]` fp32 block tensor."""

    out: torch.Tensor  # dequantized values (fp32), NaN canonical
    q: torch.Tensor  # element values on the signed element grid (fp32)
    sat: torch.Tensor  # bool: |scaled value| beyond the element max normal (clipped)
    scales: torch.Tensor  # [n_blocks]: E8M0 codes (uint8), e4m3 block scales or int scales (fp32)
    tensor_scale: torch.Tensor | None = None  # NVFP4 two-level: the fp32 per-tensor factor
    max4: torch.Tensor | None = None  # NVFP4 four over six: [n_blocks] bool, block kept max/4


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole tensor as a 0-dim fp32 tensor (NaN propagates; empty gives 0)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)
