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
from qtransform.formats.registry import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    INT8_MX,
    ROUNDINGS,
    ElementSpec,
    Family,
    FormatSpec,
    register,
    register_family,
)

E_MIN, E_MAX = -127, 127  # E8M0 range; code = E + 127, code 0xFF = NaN
NAN_CODE = 255
# floor (OCP v1.0) is the default; "compressed-tensors" is "even" at E2M1's mantissa width for
# every element (its MXFP8 rounds amax as its MXFP4 does), so for mxfp4 the two are one rule
SCALE_RULES = ("floor", "rceil", "ceil", "even", "compressed-tensors")


def shared_exponent(amax: torch.Tensor, elem: ElementSpec, rule: str) -> torch.Tensor:
    """Unbiased shared exponent E (int32) of finite block amaxes > 0.

    Other amaxes (0, Inf, NaN) give some E in [E_MIN, E_MAX] without an error: callers mask it.
    """
    if rule == "floor":
        e = floor_log2(amax) - elem.emax
    elif rule == "ceil":
        e = ceil_log2(amax) - elem.emax
    elif rule == "rceil":
        v = divide(amax, elem.max_normal)  # fp32 quotient, rounded to nearest even
        # an underflowed quotient means the smallest scale
        e = torch.where(v > 0, ceil_log2(v), E_MIN)
    elif rule in ("even", "compressed-tensors"):
        mbits = elem.mbits if rule == "even" else E2M1.mbits
        bits = amax.view(torch.int32) + (1 << (22 - mbits))  # round half up on the bits
        e = torch.where(bits < 0x7F800000, floor_log2(bits.view(torch.float32)), 128) - elem.emax
    else:
        raise ValueError(f"unknown scale_rule {rule!r}")
    return e.clamp(E_MIN, E_MAX)


def quantize_mx(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None) -> BlockQuant:
    """Quantize every block: amax, shared exponent, exact scaling, element rounding."""
    elem = cfg.spec.element
    amax = blocks.abs().amax(dim=1)
    bad = ~torch.isfinite(amax)  # NaN or Inf in the block: all-NaN block, scale code 0xFF
    zero = amax == 0
    # the exponent of a bad block is masked below, like everything else of that block
    e = torch.where(zero, E_MIN, shared_exponent(amax, elem, cfg.scale_rule))
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


def exponents(res: BlockQuant) -> torch.Tensor:
    """The unbiased shared exponent of every block from its E8M0 code (NaN blocks: 128)."""
    return torch.where(res.scales == NAN_CODE, 128, res.scales.to(torch.int32) - 127)


def scale_values(scales: torch.Tensor, tensor_scale: torch.Tensor | None, cfg: QuantConfig) -> torch.Tensor:  # noqa: ARG001
    """E8M0 codes -> 2^E (code 0xFF: NaN)."""
    code = scales.to(torch.int32)
    return torch.where(code == NAN_CODE, CANONICAL_NAN, pow2(code - 127))


MX = register_family(Family(
    "mx", {"scale_rule": SCALE_RULES, "rounding": ROUNDINGS},
    quantize=lambda blocks, cfg, u, amax_t, scale_t=None: quantize_mx(blocks, cfg, u),
    scale_values=scale_values, exponents=exponents, kernel_id=0,
))
for _name, _elem, _desc in [
    ("mxfp4", E2M1, "OCP MX: FP4 E2M1 elements, E8M0 power-of-two scale per 32"),
    ("mxfp6_e2m3", E2M3, "OCP MX: FP6 E2M3 elements, E8M0 scale per 32"),
    ("mxfp6_e3m2", E3M2, "OCP MX: FP6 E3M2 elements, E8M0 scale per 32"),
    ("mxfp8_e4m3", E4M3, "OCP MX: FP8 E4M3 elements, E8M0 scale per 32"),
    ("mxfp8_e5m2", E5M2, "OCP MX: FP8 E5M2 elements, E8M0 scale per 32"),
    ("mxint8", INT8_MX, "OCP MX: INT8 (1.6 fixed point) elements, E8M0 scale per 32"),
]:
    register(FormatSpec(
        name=_name, family=MX, element=_elem, default_block=32, scale="e8m0", tile=(32, 32),
        onnx_op=_name.upper().replace("_", "") + "FakeQuant", description=_desc,
    ))
