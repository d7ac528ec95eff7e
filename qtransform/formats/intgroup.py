"""Symmetric integer groups: an fp32 scale amax / qmax per group, no zero point."""

from __future__ import annotations

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, divide, round_signed
from qtransform.formats.options import QuantConfig


def quantize_int(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None) -> BlockQuant:
    """q = clamp(round(x / scale), -qmax, qmax); a zero (or underflowed) scale gives signed zeros.

    A NaN or Inf in a group makes the whole group NaN, as for MX blocks.
    """
    elem = cfg.spec.element
    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    scale = torch.where(bad, CANONICAL_NAN, divide(amax, elem.qmax))
    div = torch.where((scale == 0) | bad, 1.0, scale)[:, None]
    y = blocks / div
    q = round_signed(y, elem, cfg.rounding, u)
    bad_b = bad[:, None]
    q = torch.where(bad_b, CANONICAL_NAN, q)
    return BlockQuant(
        out=q * scale[:, None], q=q, sat=(y.abs() > elem.qmax) & ~bad_b, scales=scale
    )
