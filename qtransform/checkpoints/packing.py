"""Bit packing of quantized elements as the checkpoint formats lay them out, each packer beside
its unpacker (our own code: the main environment has no compressed-tensors).

- 4-bit float elements (E2M1 codes, sign in bit 3): two per byte, the even column in the low
  nibble (compressed-tensors' `pack_fp4_to_uint8`, ModelOpt's NVFP4 export).
- integers of b <= 8 bits: offset to unsigned (q + 2^(b-1)) and packed densely into int32 words,
  element i at bit i*b of its row's bit stream, little end first (compressed-tensors'
  `pack_to_int32`, format `pack-quantized`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qtransform.errors import UserError
from qtransform.formats.elements import decode_elements
from qtransform.formats.registry import E2M1


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (magnitude index in 0, .5, 1, 1.5, 2, 3, 4, 6; sign in bit 3, -0 included)
    of values exactly on the E2M1 grid: 2|q| is one of 0..4, 6, 8, 12."""
    m = (q.abs() * 2).to(torch.uint8)
    code = torch.where(m <= 4, m, torch.where(m == 12, 7, (m >> 1) + 2))
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes of 4 bits, shape [..., n] with n even -> uint8 [..., n / 2]."""
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even row length, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed integers in [-2^(bits-1), 2^(bits-1) - 1], shape [rows, n] -> int32
    [rows, ceil(n * bits / 32)]: each row one little-endian bit stream of offset values."""
    if not 1 <= bits <= 8:
        raise ValueError(f"int32 packing takes 1..8 bits, got {bits}")
    rows, n = values.shape
    words = math.ceil(n * bits / 32)
    u = (values.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    pos = torch.arange(n, dtype=torch.int64) * bits
    out = torch.zeros(rows, words + 1, dtype=torch.int64)
    word, shift = pos // 32, pos % 32
    out.scatter_add_(1, word.expand(rows, n), u << shift)  # bits that fit in the word
    spill = shift + bits - 32  # bits that run past the word go to the next one
    over = spill > 0
    if bool(over.any()):
        out.scatter_add_(1, (word[over] + 1).expand(rows, -1), u[:, over] >> (bits - spill[over]))
    out = out[:, :words] & 0xFFFFFFFF
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def unpack_fp4(packed: Tensor) -> Tensor:
    """fp32 E2M1 values of uint8 bytes holding two codes each, the even element in the low nibble
    (compressed-tensors' and ModelOpt's order)."""
    if packed.dtype != torch.uint8:
        raise UserError(f"packed FP4 weights must be uint8, not {packed.dtype}")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return decode_elements(codes, E2M1)


def e8m0_values(codes: Tensor) -> Tensor:
    """fp32 powers of two 2^(code - 127) of E8M0 scale codes (255, NaN, is refused upstream by
    the library that wrote them; here it decodes to NaN)."""
    values = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes.to(torch.int32) - 127)
    return torch.where(codes == 255, torch.full_like(values, float("nan")), values)


def unpack_int32(words: Tensor, bits: int, cols: int) -> Tensor:
    """Signed integers packed densely along the last axis of int32 words (element i at bit
    i*bits of the row's little-endian bit stream, stored as value + 2^(bits-1)), cut to `cols`."""
    if words.dtype != torch.int32:
        raise UserError(f"packed integer weights must be int32, not {words.dtype}")
    rows = words.shape[0]
    stream = words.contiguous().view(torch.uint8).reshape(rows, -1)  # little-endian bytes
    if bits == 8:
        values = stream.to(torch.int32)
    elif bits == 4:
        values = torch.stack((stream & 0x0F, stream >> 4), dim=-1).reshape(rows, -1).to(torch.int32)
    else:
        bit = (stream.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        flat = bit.reshape(rows, -1)[:, : (flat_len := (bit.shape[1] * 8) // bits * bits)]
        weights = 2 ** torch.arange(bits, dtype=torch.int32)
        values = (flat.reshape(rows, flat_len // bits, bits).to(torch.int32) * weights).sum(-1)
    if values.shape[1] < cols:
        raise UserError(f"packed weights hold {values.shape[1]} values per row, the shape says {cols}")
    return values[:, :cols] - (1 << (bits - 1))
