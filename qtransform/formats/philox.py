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

import math

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


# -- the Gaussian stream ------------------------------------------------------------------------
# Counter c of Philox4x32-10 under the seed's key gives the standard normals of elements 4c .. 4c+3
# (row-major position in the drawn tensor): words (w0, w1) and (w2, w3) are Box-Muller pairs, with
# u1 = ((w_even >> 8) + 1) * 2^-24 in (0, 1] and the angle 2*pi * (w_odd >> 8) * 2^-24; element
# 4c + 2p is r*cos(angle), 4c + 2p + 1 is r*sin(angle), r = sqrt(-2 ln u1) (so |z| <= 5.77).
# ln, sin and cos are fixed polynomials after an exact range reduction (the exponent of u1, the
# octant of the angle), and every operation is one IEEE-rounded fp32 +, -, *, / or sqrt in a
# fixed order, so torch on any device and qfast.c (compiled without FMA contraction) give the same
# bits. The constants, as fp32 values (qfast.c receives this very list):
NORMAL_CONSTANTS = (math.sqrt(2.0), math.log(2.0), math.pi / 4,  # then ln's, sin's and cos's:
                    1 / 3, 1 / 5, 1 / 7, 1 / 9,  # ln m = 2s (1 + s^2/3 + ...), s = (m-1)/(m+1)
                    -1 / 6, 1 / 120, -1 / 5040, 1 / 362880,  # sin x = x (1 - x^2/6 + ...)
                    -1 / 2, 1 / 24, -1 / 720, 1 / 40320, -1 / 3628800)  # cos x = 1 - x^2/2 + ...


def _constants(device: torch.device) -> list[torch.Tensor]:
    return list(torch.tensor(NORMAL_CONSTANTS, dtype=torch.float32, device=device).unbind())


def _horner(x2: torch.Tensor, coefficients: list[torch.Tensor]) -> torch.Tensor:
    """((c_n x2 + c_n-1) x2 + ... + c_1) x2 + 1, one rounding per operation."""
    p = coefficients[-1] * x2
    for c in reversed(coefficients[:-1]):
        p = (p + c) * x2
    return p + 1.0


def box_muller(w_radius: torch.Tensor, w_angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r cos, r sin) of Box-Muller pairs given as 32-bit words (int64 tensors), fp32."""
    sqrt2, ln2, pi4, *k = _constants(w_radius.device)
    f = ((w_radius >> 8) + 1).to(torch.float32)  # 1 .. 2^24, exact
    bits = f.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    big = m > sqrt2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int32)
    s = (m - 1.0) / (m + 1.0)
    lnm = (s + s) * _horner(s * s, k[0:4])
    ln = (e - 24).to(torch.float32) * ln2 + lnm
    r = torch.sqrt((ln * -2.0).double()).float()  # torch.sqrt of fp32 is not correctly rounded
    # on every CPU path; in float64 then rounded it is (53 >= 2 * 24 + 2 bits)
    a = w_angle >> 8
    octant, f21 = a >> 21, a & 0x1FFFFF
    odd = (octant & 1) == 1
    t = torch.where(odd, 0x200000 - f21, f21).to(torch.float32) * 2.0**-21  # exact
    phi = t * pi4
    x2 = phi * phi
    sn = phi * _horner(x2, k[4:8])
    cs = _horner(x2, k[8:13])
    ca, sa = torch.where(odd, sn, cs), torch.where(odd, cs, sn)
    q = octant >> 1
    c = torch.where(q == 0, ca, torch.where(q == 1, -sa, torch.where(q == 2, -ca, sa)))
    sv = torch.where(q == 0, sa, torch.where(q == 1, ca, torch.where(q == 2, -sa, -ca)))
    return r * c, r * sv


def normal_at(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """fp32 standard normals of the elements at linear `positions` (int64, on their device)."""
    ctr = positions >> 2
    zero = torch.zeros_like(ctr)
    w = philox4x32((ctr & MASK32, ctr >> 32, zero, zero), split_seed(seed))
    pair = (positions & 2) == 2
    zc, zs = box_muller(torch.where(pair, w[2], w[0]), torch.where(pair, w[3], w[1]))
    return torch.where((positions & 1) == 1, zs, zc)


def normal(seed: int, shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """The first numel(shape) normals of the stream of `seed`, shaped `shape`."""
    n = math.prod(shape)
    return normal_at(seed, torch.arange(n, device=device, dtype=torch.int64)).reshape(shape)


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
