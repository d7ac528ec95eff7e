"""OCP MX block scaling: one power-of-two (E8M0) scale per block.

The shared exponent follows `scale_rule` (floor is OCP v1.0; rceil, ceil and even are the rules
of other toolchains, see docs/numerics.md). y = x / 2^E and q * 2^E are exact, so the element
rounding alone decides every output.
"""

from __future__ import annotations

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import (
    CANONICAL_NAN,
    ceil_log2,
    divide,
    floor_log2,
    pow2,
    round_magnitude,
)
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import ElementSpec

E_MIN, E_MAX = -127, 127  # E8M0 range; code = E + 127, code 0xFF = NaN
NAN_CODE = 255


def shared_exponent(amax: torch.Tensor, elem: ElementSpec, rule: str) -> torch.Tensor:
    """Unbiased shared exponent E (int32) for block amaxes that are finite and > 0."""
    if rule == "floor":
        e = floor_log2(amax) - elem.emax
    elif rule == "ceil":
        e = ceil_log2(amax) - elem.emax
    elif rule == "rceil":
        v = divide(amax, elem.max_normal)  # fp32 quotient, rounded to nearest even
        # an underflowed quotient means the smallest scale
        e = torch.where(v > 0, ceil_log2(torch.where(v > 0, v, 1.0)), E_MIN)
    elif rule == "even":
        bits = amax.view(torch.int32) + (1 << (22 - elem.mbits))  # round half up on the bits
        rounded = torch.where(bits < 0x7F800000, bits, 0x3F800000).view(torch.float32)
        e = torch.where(bits < 0x7F800000, floor_log2(rounded), 128) - elem.emax
    else:
        raise ValueError(f"unknown scale_rule {rule!r}")
    return e.clamp(E_MIN, E_MAX)


def quantize_mx(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None) -> BlockQuant:
    """Quantize every block: amax, shared exponent, exact scaling, element rounding."""
    elem = cfg.spec.element
    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)  # NaN or Inf in the block: all-NaN block, scale code 0xFF
    zero = amax == 0
    safe = torch.where(bad | zero, 1.0, amax)
    e = torch.where(zero, E_MIN, shared_exponent(safe, elem, cfg.scale_rule))
    scale = pow2(e)[:, None]
    y = blocks / scale
    a = y.abs()
    q = torch.copysign(round_magnitude(a, elem, cfg.rounding, u), y)
    bad_b = bad[:, None]
    out = torch.where(bad_b, CANONICAL_NAN, q * scale)
    codes = torch.where(bad, NAN_CODE, e + 127).to(torch.uint8)
    return BlockQuant(
        out=out,
        q=torch.where(bad_b, CANONICAL_NAN, q),
        sat=(a > elem.max_normal) & ~bad_b,
        scales=codes,
    )
