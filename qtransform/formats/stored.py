"""The stored numbers of a fake-quantized weight: its elements on the format's grid and its
scales, computed by the formats' own kernels (`formats.quantize.quantize_blocks`, the compiled
packing pass), so that a checkpoint decodes to exactly what the simulation computed. The one
encoder every checkpoint writer calls (`qtransform.export.checkpoint`); the writers only lay
these numbers out in their format's tensors.

A weight is quantized in chunks of whole rows (whole tiles), each chunk with the tensor-level
amax the site's fake-quant uses (its own, its scale group's), so the temporaries stay a fraction
of the tensor and the result is that of the whole tensor at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from qtransform.formats import QuantConfig, fastpath
from qtransform.formats.blocking import from_blocks, per_block, tensor_amax, to_blocks
from qtransform.formats.quantize import fake_quantize, layout_for, quantize_blocks
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
            yield _fast(part, start, config, amax) or _reference(part, start, config, amax)


def fp4_stored(weight: Tensor, config: QuantConfig,
               amax: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None] | None:
    """The stored numbers of a 2-D weight in one compiled pass, for compressed-tensors' NVFP4
    (packed E2M1 codes, E4M3 block scales, the fp32 tensor scale g), ModelOpt's NVFP4 (the same
    with its decode scale d and its sign bits) and MXFP4 (packed codes, E8M0 exponents + 127,
    None), rounding to nearest even on 1-D blocks along rows: what `weight_chunks` gives, already
    stored; None where the kernel does not cover `config` or the weight (then `weight_chunks`
    decides). `amax` as there. NVFP4's tensor scale is the reference's own scalar arithmetic, so
    the kernel repeats only the per-block and per-element operations."""
    if (config.rounding != "rne" or config.tile or config.granularity != "block"
            or config.block_axis not in (-1, 1) or weight.dim() != 2):
        return None
    if config.name == "mxfp4" and config.block == 32:
        found = fastpath.mxfp4_pack(weight, config)
        return None if found is None else (*found, None)
    if (config.family.name != "nvfp4" or config.block != 16 or config.four_over_six != "none"
            or config.nvfp4_variant not in ("compressed-tensors", "modelopt")):
        return None
    if amax is None:
        amax = tensor_amax(weight)
    if amax.ndim:
        return None
    _, g = scale_of(config, amax, weight.dtype)
    assert g is not None
    found = fastpath.nvfp4_pack(weight, float(g), stored_scale_dtype(config, weight.dtype),
                                modelopt=config.nvfp4_variant == "modelopt")
    return None if found is None else (*found, g.to(torch.float32).reshape(()))


def _reference(part: Tensor, start: int, config: QuantConfig, amax: Tensor | None) -> Chunk:
    """The formats' reference path on the chunk: elements and scales from one quantization."""
    res, layout = quantize_blocks(part, config, amax_t=amax)
    return Chunk(start, from_blocks(res.q, layout), per_block(res.scales, layout), res.tensor_scale)


def _fast(part: Tensor, start: int, config: QuantConfig, amax: Tensor | None) -> Chunk | None:
    """The same numbers from `fake_quantize` (the compiled kernel where it applies) and the scales
    of the block amaxes alone (the family's scale arithmetic on one-element blocks); the elements
    are the values over their multipliers, snapped to the grid and checked: decoding them must
    give the fake-quantized values bit for bit, else None (the reference path decides).

    Four over six chooses each block's scale from its elements, not its amax alone, and the
    stored scale must be the one chosen (a max/4 block whose elements are also on the max/6
    grid would otherwise be stored as max/6 with other codes): the reference path stores it."""
    if config.family.name == "nvfp4" and config.four_over_six != "none":
        return None
    per_tensor = config.family.per_tensor(config)
    out = fake_quantize(part, config, amax=amax if per_tensor else None)
    layout = layout_for(part, config)
    rows, cols = part.shape
    # blocks along whole rows (the usual Linear weight): 3-D views instead of block copies
    flat = layout.tile is None and layout.axis == 1 and cols % layout.block == 0
    shape3 = (rows, cols // max(layout.block, 1), layout.block)
    blocks = part.detach().reshape(shape3) if flat else to_blocks(part.detach(), layout)
    block_amax = blocks.abs().amax(dim=-1).reshape(-1)  # exact in part's dtype
    one = replace(config, block=1, tile=None, granularity="block", axis=-1)
    res, _ = quantize_blocks(block_amax.reshape(-1, 1), one, amax_t=amax if per_tensor else None)
    mult = config.family.scale_values(res.scales, res.tensor_scale, config)
    if not bool(torch.isfinite(mult).all()) or not bool((mult > 0).all()) or _ambiguous(mult, config, part.dtype):
        return None
    if flat:
        spread = mult.reshape(shape3[0], shape3[1], 1)
        y = out.reshape(shape3).to(torch.float32, copy=True).div_(spread)
    else:
        spread = from_blocks(mult[:, None].expand(-1, layout.tile[0] * layout.tile[1] if layout.tile
                                                  else layout.block), layout)
        y = out.to(torch.float32, copy=True).div_(spread)
    q = _snap(y, config)
    if q is None or not torch.equal((q * spread).to(part.dtype), out.reshape(q.shape)):
        return None
    return Chunk(start, q.reshape(rows, cols), per_block(res.scales, layout), res.tensor_scale)


def _ambiguous(mult: Tensor, config: QuantConfig, dtype: torch.dtype) -> bool:
    """Whether two grid values of some block can round to one value of `dtype` (the block's
    smallest step times its multiplier below the dtype's normals, or its largest value past the
    dtype's range): there the fake-quantized values do not tell which element was stored."""
    elem = config.spec.element
    if elem.kind == "int":
        step, top = elem.step, (elem.qmax + 1) * elem.step
    else:
        step, top = 2.0 ** (elem.emin - elem.mbits), elem.max_normal
    info = torch.finfo(dtype)
    return bool((mult.amin() * step < info.tiny) | (mult.amax() * top > info.max))


def _snap(y: Tensor, config: QuantConfig) -> Tensor | None:
    """Values within rounding of the element grid, put on it (None: no fast rule here); `y` is
    a scratch tensor the caller gives up."""
    elem = config.spec.element
    if elem.kind == "int":
        return y.round_()
    if elem.name == "e2m1":  # 2|y| rounds to one of 0..4, 6, 8, 12
        return y.abs().mul_(2).round_().div_(2).copysign_(y)
    if elem.name == "e4m3":
        return y.to(torch.float8_e4m3fn).to(torch.float32)
    return None


def scale_of(config: QuantConfig, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """The scale (and NVFP4 tensor scale) `config` computes from a tensor-level `amax` for a
    tensor of `dtype`: what a static activation scale is stored as."""
    zeros = torch.zeros(1, max(config.block, 1), dtype=dtype)
    res, _ = quantize_blocks(zeros, config, amax_t=amax.to(torch.float32))
    return res.scales[0], res.tensor_scale


def stored_input_scale(config: QuantConfig, scale: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """`scale_of` for a stored tensor-level scale (a checkpoint's, used as stored: NVFP4's g or
    d, FP8's or int's s) instead of an amax, as the format uses it."""
    zeros = torch.zeros(1, max(config.block, 1), dtype=dtype)
    res, _ = quantize_blocks(zeros, config, scale_t=scale)
    return res.scales[0], res.tensor_scale


def stored_scale_dtype(config: QuantConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a plain (FP8 / integer) scale is computed in, and so stored in, for a tensor of
    `dtype` (`scale_dtype` "input" is the tensor's own)."""
    return SCALE_TORCH_DTYPES[bind_dtype(config, dtype).scale_dtype]
