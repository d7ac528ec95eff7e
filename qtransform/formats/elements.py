"""Element grids: exact exponent arithmetic, rounding one magnitude to a grid, bit codes.

Everything here is exact fp32 arithmetic on whole tensors (no Python loops, no host round trips),
so the same code runs on any device and the C fast path can mirror it operation for operation.
"""

from __future__ import annotations

import torch

from qtransform.formats.registry import ElementSpec

CANONICAL_NAN = float("nan")  # +qNaN, bits 0x7fc00000: every NaN we output has these bits


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(a)) for finite a > 0 (fp32 subnormals included), as int32.

    `floor(log2(x))` on floats is off by one just below powers of two; frexp reads the exponent.
    """
    return torch.frexp(a)[1] - 1


def ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(a)) for finite a > 0: floor_log2 + 1 unless a is a power of two."""
    mant, exp = torch.frexp(a)
    return exp - (mant == 0.5).to(torch.int32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2^k in fp32 for integer k in [-149, 127], built from bits (2^-127 is subnormal)."""
    k = k.to(torch.int32)
    # the branch not selected may shift out of range: its value is read nowhere. (At k = -126
    # both branches give 2^-126: the split is at -127, where a moved bound would be wrong.)
    bits = torch.where(k > -127, (k + 127) << 23, torch.ones_like(k) << (k + 149))
    return bits.view(torch.float32)


def divide(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b as a true fp32 division on every device.

    CUDA computes `tensor / python_scalar` as a multiplication by the rounded reciprocal, which is
    not bit-identical; a 0-dim tensor divisor on a's device keeps the true division.
    """
    return a / a.new_tensor(b)


def round_to_integer(t: torch.Tensor, rounding: str, u: torch.Tensor | None) -> torch.Tensor:
    """Round non-negative t to an integer: half-to-even, half-away, toward zero (truncation, as
    vLLM's CPU KV-cache writer converts to FP8), or floor(t + u)."""
    if rounding == "rne":
        return torch.round(t)
    if rounding == "rna":
        return torch.floor(t + 0.5)
    if rounding == "rtz":
        return torch.floor(t)
    assert u is not None, "stochastic rounding needs uniform draws"
    return torch.floor(t + u)


# torch's own float8 dtypes: rounding to nearest even onto them is one saturated cast
FLOAT8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def round_magnitude(
    a: torch.Tensor, elem: ElementSpec, rounding: str = "rne", u: torch.Tensor | None = None
) -> torch.Tensor:
    """Round |y| (fp32, >= 0) onto the element grid and saturate at its max normal.

    Float elements: step = 2^(max(floor_log2 a, emin) - mbits), so a / step is exact and only the
    integer rounding decides; int elements have a fixed step. The exponent field of a is exact
    wherever it matters (fp32 subnormals lie far below every element's emin, so they take emin),
    and both powers of two are normal numbers built from bits. FP8 elements round to nearest
    even by torch's cast to its float8 dtype (the same IEEE rounding, saturated first), and
    toward zero by clearing the mantissa bits they do not keep (their subnormals: a multiple of
    the subnormal step): fewer operations for the same bits (tests/formats/test_elements.py).
    """
    dtype = FLOAT8_DTYPES.get(elem.name) if elem.kind == "float" else None
    if dtype is not None and rounding == "rne":
        return torch.clamp_max(a, elem.max_normal).to(dtype).to(torch.float32)
    if dtype is not None and rounding == "rtz":
        kept = (a.view(torch.int32) & -(1 << (23 - elem.mbits))).view(torch.float32)
        sub = 2.0 ** (elem.emin - elem.mbits)
        low = torch.floor(a * (1.0 / sub)) * sub
        out = torch.clamp_max(torch.where(a < 2.0**elem.emin, low, kept), elem.max_normal)
        return torch.where(torch.isnan(a), a, out)  # a NaN's low mantissa bits are not cleared
    if elem.kind == "float":
        e = ((a.view(torch.int32) >> 23) - 127).clamp_min(elem.emin) - elem.mbits
        t = a * ((127 - e) << 23).view(torch.float32)
        r = round_to_integer(t, rounding, u) * ((127 + e) << 23).view(torch.float32)
    else:
        t = a * (1.0 / elem.step)
        r = round_to_integer(t, rounding, u) * elem.step
    return torch.clamp_max(r, elem.max_normal)


def round_signed(
    y: torch.Tensor, elem: ElementSpec, rounding: str = "rne", u: torch.Tensor | None = None
) -> torch.Tensor:
    """Round y onto the signed element grid with saturation; the sign is copied, so -0.0 stays."""
    return torch.copysign(round_magnitude(y.abs(), elem, rounding, u), y)


def code_table(elem: ElementSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """Magnitude of every unsigned code 0 .. 2^(bits-1)-1; codes off the finite grid read NaN."""
    grid = elem.grid()
    table = torch.full((2 ** (elem.bits - 1),), CANONICAL_NAN, dtype=torch.float32)
    table[: grid.numel()] = grid
    return table.to(device)


def encode_elements(q: torch.Tensor, elem: ElementSpec) -> torch.Tensor:
    """Bit codes (uint8, sign in bit bits-1) of values already on the signed grid.

    The magnitude code is the index in the ascending grid (IEEE-like and integer codes are both
    monotone in magnitude); int elements are sign-magnitude so that -0.0 survives a round trip.
    NaN values get code 0: their block scale carries the NaN.
    """
    grid = q.new_tensor(elem.grid().tolist())  # on q's device (grid values are exact in any float)
    mag = torch.nan_to_num(q.abs())  # NaN -> 0
    idx = torch.searchsorted(grid, mag.contiguous())
    sign = torch.signbit(q) & ~torch.isnan(q)
    return (idx | torch.where(sign, 1 << (elem.bits - 1), 0)).to(torch.uint8)


def decode_elements(codes: torch.Tensor, elem: ElementSpec) -> torch.Tensor:
    """Signed fp32 values of element bit codes (inverse of `encode_elements`)."""
    c = codes.to(torch.int64)
    sign_bit = 1 << (elem.bits - 1)
    mag = code_table(elem, codes.device)[c & (sign_bit - 1)]
    return torch.where((c & sign_bit) != 0, -mag, mag)


def twos_complement(codes: torch.Tensor, elem: ElementSpec) -> torch.Tensor:
    """Sign-magnitude int element codes as ordinary signed integers (int8); -0 becomes 0."""
    if elem.kind != "int":
        raise ValueError(f"{elem.name}: two's complement codes only exist for integer elements")
    sign_bit = 1 << (elem.bits - 1)
    mag = (codes & (sign_bit - 1)).to(torch.int8)  # at most 127, so -mag fits too
    return torch.where((codes & sign_bit) != 0, -mag, mag)
