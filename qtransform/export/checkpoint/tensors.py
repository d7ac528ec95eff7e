"""The stored numbers of a fake-quantized weight: its elements on the format's grid and its
scales, computed by the formats' own kernels (`formats.quantize.quantize_blocks`), so that a
checkpoint decodes to exactly what the simulation computed.

A weight is quantized in chunks of whole rows (whole tiles), each chunk with the tensor-level
amax the site's fake-quant uses (its own, its scale group's), so the temporaries stay a fraction
of the tensor and the result is that of the whole tensor at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from qtransform.formats import QuantConfig
from qtransform.formats.blocking import from_blocks, per_block, tensor_amax
from qtransform.formats.quantize import quantize_blocks
from qtransform.formats.registry import SCALE_TORCH_DTYPES
from qtransform.formats.scaled import bind_dtype

CHUNK_ELEMENTS = 1 << 20  # elements of the weight quantized at once


@dataclass(frozen=True)
class Chunk:
    """Rows `start:start + rows` of a quantized 2-D weight."""

    start: int
    elements: Tensor  # fp32 values on the signed element grid, [rows, in]
    scales: Tensor  # per block, [rows / tile rows, blocks per row]: E8M0 codes, E4M3 values or plain scales
    tensor_scale: Tensor | None  # NVFP4 two-level: the per-tensor factor (0-dim fp32)


def weight_chunks(weight: Tensor, config: QuantConfig, amax: Tensor | None) -> Iterator[Chunk]:
    """`weight` [out, in] quantized with `config` (blocks along its last axis) in row chunks;
    `amax` replaces the tensor's own amax for the tensor-level scale (None: its own)."""
    if amax is None and config.family.per_tensor(config):
        amax = tensor_amax(weight)
    rows, cols = weight.shape
    unit = config.tile[0] if config.tile else 1
    step = max(unit, CHUNK_ELEMENTS // max(cols, 1) // unit * unit)
    with torch.no_grad():
        for start in range(0, rows, step):
            part = weight[start:start + step]
            row_amax = amax if amax is None or not amax.ndim else amax[start:start + step]
            res, layout = quantize_blocks(part, config, amax_t=row_amax)
            yield Chunk(start, from_blocks(res.q, layout), per_block(res.scales, layout),
                        res.tensor_scale)


def scale_of(config: QuantConfig, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The scale (and NVFP4 tensor scale) `config` computes from a tensor-level `amax` for a
    tensor of `dtype`: what a static activation scale is stored as."""
    zeros = torch.zeros(1, max(config.block, 1), dtype=dtype)
    res, _ = quantize_blocks(zeros, config, amax_t=amax.to(torch.float32))
    return res.scales[0], res.tensor_scale


def stored_scale_dtype(config: QuantConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a plain (FP8 / integer) scale is computed in, and so stored in, for a tensor of
    `dtype` (`scale_dtype` "input" is the tensor's own)."""
    return SCALE_TORCH_DTYPES[bind_dtype(config, dtype).scale_dtype]
