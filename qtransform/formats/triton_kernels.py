"""The GPU fast path: Triton kernels for MX and NVFP4 fake quantization, bit-identical to the
reference path (`mx.py`, `nvfp4.py`).

Eager torch spends a memory pass per elementwise op; these kernels read each block once, compute
its scale and elements in registers and write the result (and the saturation mask) once.
Importing this module imports triton: `quantize.py` imports it only for CUDA tensors, and falls
back to the reference path when triton is absent or `quantize` returns None.

Covered: 1D blocks along any axis (moved last), every MX format and scale rule, NVFP4's
`default` (four over six included) and `one_level` variants, `rne` and `rna` rounding, fp32/bf16/fp16 in and out. Not
covered (reference path, which runs on CUDA unchanged): 2D tiles, stochastic rounding, the
`compressed-tensors` NVFP4 order, integer groups, MX block exponents, float64.

Why the results are the same bits as the reference:

- every division is `div_rn` (correctly rounded; Triton's `/` on fp32 is an approximate
  division on GPUs) and kernels are compiled with `enable_fp_fusion=False` (no FMA contraction);
  a division by an MX scale 2^e is the multiplication by 2^-e (exact for -127 <= e <= 127, so
  both round the same real quotient), and NVFP4's reciprocal scale is divided once per block;
- amaxes are maxima of the absolute *bit patterns* (integers order non-negative floats, and a
  NaN or Inf shows as a pattern >= 0x7f800000: the hardware float max drops NaNs);
- exponents are read from bits (subnormals are scaled by 2^64 first), powers of two are built
  from bits, clamps are `where`s that keep NaN as torch's clamps do;
- round half to even is `(t + 2^23) - 2^23`, exact for the 0 <= t < 2^22 that element rounding
  ever sees; the sign is copied from the bits, so -0.0 stays;
- bf16 is widened and rounded to nearest even on the bits (the interpreter's own casts truncate
  and mishandle subnormals);
  every NaN written is the canonical quiet NaN of the output dtype.

`TRITON_INTERPRET=1` (set before importing triton) runs the same kernels on CPU tensors:
tests/formats/test_triton_kernels.py checks them there against the reference, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qtransform.formats.blocking import BlockLayout, tensor_amax
from qtransform.formats.options import QuantConfig

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RULES = {"floor": 0, "ceil": 1, "rceil": 2, "even": 3}
KERNEL_MX, KERNEL_NVFP4 = 0, 1  # the `Family.kernel_id`s these kernels implement
BLOCKS_PER_PROGRAM = 64
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # jit code may read globals that are constexprs only


@triton.jit
def _floor_log2_and_mant(a):
    """(floor(log2 a), a is not a power of two) for finite a > 0, subnormals included."""
    bits = a.to(tl.int32, bitcast=True)
    sub = (bits >> 23) == 0
    scaled = tl.where(sub, a * 18446744073709551616.0, a)  # * 2^64, exact
    sbits = scaled.to(tl.int32, bitcast=True)
    e = (sbits >> 23) - 127 - tl.where(sub, 64, 0)
    return e, (sbits & 0x7FFFFF) != 0


@triton.jit
def _pow2(k):
    """Exact 2^k in fp32 for integer k in [-149, 127], from bits (2^-127 is subnormal)."""
    normal = tl.minimum(tl.maximum(k + 127, 1), 254) << 23
    sub = tl.full(k.shape, 1, tl.int32) << tl.minimum(tl.maximum(k + 149, 0), 22)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _round_int(t, RNA: tl.constexpr):
    """Round 0 <= t < 2^22 to an integer: half to even, or half away from zero (RNA)."""
    if RNA:
        r = tl.floor(t + 0.5)
    else:
        r = (t + 8388608.0) - 8388608.0
    return r


@triton.jit
def _round_magnitude(a, IS_FLOAT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                     INV_STEP: tl.constexpr, STEP: tl.constexpr, MAX_NORMAL: tl.constexpr,
                     RNA: tl.constexpr):
    """`elements.round_magnitude`: a >= 0 (or NaN) onto the element grid, saturated."""
    if IS_FLOAT:
        e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, EMIN) - MBITS
        t = a * ((127 - e) << 23).to(tl.float32, bitcast=True)
        r = _round_int(t, RNA) * ((127 + e) << 23).to(tl.float32, bitcast=True)
    else:
        r = _round_int(a * INV_STEP, RNA) * STEP
    return tl.where(r > MAX_NORMAL, MAX_NORMAL, r)


@triton.jit
def _copysign(m, y):
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (m.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(v):
    return _round_magnitude(v, True, -6, 3, 1.0, 1.0, 448.0, False)


@triton.jit
def _nvfp4_candidate(x, s, d):
    """Scaled values and per-element dequantization scale of blocks under block scales s."""
    sd = s * d
    enc = tl.math.div_rn(tl.full(sd.shape, 1.0, tl.float32), sd)  # once per block
    enc = tl.where(enc > FLT_MAX, FLT_MAX, enc)
    return x * enc[:, None], sd[:, None] + tl.zeros(x.shape, tl.float32)


@triton.jit
def _block_error(x, y, scale, FOS: tl.constexpr, RNA: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_P2: tl.constexpr, STAGES: tl.constexpr):
    """`nvfp4.block_error`: |out - x| (FOS 2) or (out - x)^2 (FOS 1) summed by halving (padded
    lanes hold x = 0, so their terms are 0)."""
    yc = tl.where(y > 6.0, 6.0, tl.where(y < -6.0, -6.0, y))
    out = _copysign(_round_magnitude(tl.abs(yc), True, 0, 1, 1.0, 1.0, 6.0, RNA), yc) * scale
    diff = out - x
    t = tl.abs(diff) if FOS == 2 else diff * diff
    for st in tl.static_range(STAGES):
        h: tl.constexpr = BLOCK_P2 >> (st + 1)
        lo, hi = tl.split(tl.permute(tl.reshape(t, (GROUP, 2, h)), (0, 2, 1)))
        t = lo + hi
    return tl.reshape(t, (GROUP,))


@triton.jit
def _fq_kernel(x_ptr, out_ptr, sat_ptr, amax_t_ptr, n_blocks, row_len, blocks_per_row,
               FAMILY: tl.constexpr, VARIANT: tl.constexpr, RULE: tl.constexpr,
               IS_FLOAT: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
               MBITS: tl.constexpr, INV_STEP: tl.constexpr, STEP: tl.constexpr,
               MAX_NORMAL: tl.constexpr, RNA: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_P2: tl.constexpr, GROUP: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
               WANT_SAT: tl.constexpr, OUT_KIND: tl.constexpr, FOS: tl.constexpr,
               G_RANGE: tl.constexpr, STAGES: tl.constexpr):
    """GROUP blocks of BLOCK elements per program; FAMILY 0 = MX, 1 = NVFP4 (VARIANT 0 default,
    1 one_level; FOS four over six 0 off, 1 MSE, 2 MAE; G_RANGE 6 x the global bound);
    OUT_KIND (the dtype of x and of the output) 0 fp32, 1 bf16, 2 fp16."""
    pid = tl.program_id(0)
    bid = pid.to(tl.int64) * GROUP + tl.arange(0, GROUP).to(tl.int64)
    row = bid // blocks_per_row
    col = (bid % blocks_per_row) * BLOCK
    k = tl.arange(0, BLOCK_P2)
    cols = col[:, None] + k[None, :]
    # the mask is per block where it can be (whole blocks, BLOCK a power of two), so the
    # compiler can vectorize loads and stores; per element only for padded lanes or ragged rows
    mask = tl.broadcast_to((bid < n_blocks)[:, None], (GROUP, BLOCK_P2))
    if BLOCK != BLOCK_P2:
        mask = mask & (k < BLOCK)[None, :]
    if not WHOLE_BLOCKS:
        mask = mask & (cols < row_len)
    offs = row[:, None] * row_len + cols
    if OUT_KIND == 1:  # bf16 widened on the bits (exact everywhere, subnormals included)
        raw = tl.load(x_ptr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0)
        x = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax_bits = tl.max(abs_bits, axis=1)  # integer order = float order for |x|; NaN on top
    nan32 = tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if FAMILY == 0:
        bad = amax_bits >= 0x7F800000
        zero = amax_bits == 0
        safe = tl.where(bad | zero, 1.0, amax_bits.to(tl.float32, bitcast=True))
        if RULE == 2:  # rceil: ceil_log2(fl32(amax / max_normal)), underflow -> -127
            v = tl.math.div_rn(safe, tl.full(safe.shape, MAX_NORMAL, tl.float32))
            fl, frac = _floor_log2_and_mant(tl.where(v > 0, v, 1.0))
            e = tl.where(v > 0, fl + frac.to(tl.int32), -127)
        elif RULE == 3:  # even: round amax to MBITS on its bits (half up), then floor
            rb = safe.to(tl.int32, bitcast=True) + (1 << (22 - MBITS))
            fl, frac = _floor_log2_and_mant(
                tl.where(rb < 0x7F800000, rb, 0x3F800000).to(tl.float32, bitcast=True))
            e = tl.where(rb < 0x7F800000, fl, 128) - EMAX
        else:
            fl, frac = _floor_log2_and_mant(safe)
            e = fl - EMAX
            if RULE == 1:
                e = e + frac.to(tl.int32)
        e = tl.minimum(tl.maximum(e, -127), 127)
        e = tl.where(zero, -127, e)
        scale = _pow2(e)[:, None] + tl.zeros(x.shape, tl.float32)
        y = x * _pow2(-e)[:, None]  # = div_rn(x, 2^e): 2^-e is exact for -127 <= e <= 127
        a = tl.abs(y)
        q = _copysign(_round_magnitude(a, IS_FLOAT, EMIN, MBITS, INV_STEP, STEP, MAX_NORMAL, RNA),
                      y)
        out = tl.where(bad[:, None], nan32, q * scale)
        sat = (a > MAX_NORMAL) & ~bad[:, None]
    else:
        amax_b = amax_bits.to(tl.float32, bitcast=True)
        if VARIANT == 0:
            amax_t = tl.load(amax_t_ptr + tl.zeros_like(amax_bits))
            g = tl.math.div_rn(tl.full(amax_t.shape, G_RANGE, tl.float32), amax_t)
            g = tl.where(g > FLT_MAX, FLT_MAX, g)
            g = tl.where(g == 0, 1.0, g)
            d = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), g)
            s = amax_b * (g * 0.16666667163372040)  # fl32(1/6)
            s = tl.where(s > FLT_MAX, FLT_MAX, s)
            s = _e4m3_rne(tl.where(s > 448.0, 448.0, s))
            y, scale = _nvfp4_candidate(x, s, d)
            if FOS != 0:  # four over six: the max/4 scale where its error sum is smaller
                s4 = amax_b * (g * 0.25)
                s4 = tl.where(s4 > FLT_MAX, FLT_MAX, s4)
                s4 = _e4m3_rne(tl.where(s4 > 448.0, 448.0, s4))
                y4, scale4 = _nvfp4_candidate(x, s4, d)
                err6 = _block_error(x, y, scale, FOS, RNA, GROUP, BLOCK_P2, STAGES)
                err4 = _block_error(x, y4, scale4, FOS, RNA, GROUP, BLOCK_P2, STAGES)
                four = (err4 < err6)[:, None]
                y = tl.where(four, y4, y)
                scale = tl.where(four, scale4, scale)
        else:
            s = tl.math.div_rn(amax_b, tl.full(amax_b.shape, 6.0, tl.float32))
            s = _e4m3_rne(tl.where(s > 448.0, 448.0, s))
            sb = s[:, None] + tl.zeros(x.shape, tl.float32)
            y = tl.where(sb == 0, x * 0.0, tl.math.div_rn(x, tl.where(sb == 0, 1.0, sb)))
            scale = sb
        yc = tl.where(y > 6.0, 6.0, tl.where(y < -6.0, -6.0, y))
        q = _copysign(_round_magnitude(tl.abs(yc), True, 0, 1, 1.0, 1.0, 6.0, RNA), yc)
        out = q * scale
        out = tl.where(out != out, nan32, out)
        sat = tl.abs(y) > 6.0
    if OUT_KIND == 0:
        tl.store(out_ptr + offs, out, mask=mask)
    else:
        if OUT_KIND == 1:  # round to nearest even on the bits (the same on every backend)
            bits = out.to(tl.int32, bitcast=True)
            narrow = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
            canon = 0x7FC0
        else:
            narrow = out.to(tl.float16).to(tl.int16, bitcast=True)
            canon = 0x7E00
        narrow = tl.where(out != out, tl.full(x.shape, canon, tl.int16), narrow)
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + offs, narrow, mask=mask)
    if WANT_SAT:
        tl.store(sat_ptr + offs, sat.to(tl.int8), mask=mask)


def supported(x: torch.Tensor, cfg: QuantConfig, layout: BlockLayout, exponents: bool) -> bool:
    """Whether the kernels cover this request (else the reference path runs)."""
    return (x.dtype in _DTYPES and x.numel() > 0 and not layout.tile and not exponents
            and cfg.rounding in ("rne", "rna") and cfg.scale_rule in _RULES
            and cfg.four_over_six_order == "pairwise"  # the stacks' orders: the reference path
            and (cfg.family.kernel_id == KERNEL_MX
                 or (cfg.family.kernel_id == KERNEL_NVFP4
                     and cfg.nvfp4_variant in ("default", "one_level"))))


def run(x: torch.Tensor, cfg: QuantConfig, layout: BlockLayout,
        want_sat: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel on x's device (CUDA, or CPU under TRITON_INTERPRET=1): (values shaped
    `layout.shape` in x's dtype, saturation mask or None)."""
    xm = x.detach().reshape(layout.shape).movedim(layout.axis, -1).contiguous()
    row_len = xm.shape[-1]
    per_row = -(-row_len // layout.block)
    n_blocks = xm.numel() // row_len * per_row
    out = torch.empty_like(xm)
    sat = torch.empty(xm.shape, dtype=torch.bool, device=x.device) if want_sat else None
    elem = cfg.spec.element
    nvfp4 = cfg.family.kernel_id == KERNEL_NVFP4
    amax_t = tensor_amax(xm).reshape(1) if nvfp4 else xm.new_zeros(1, dtype=torch.float32)
    grid = (triton.cdiv(n_blocks, BLOCKS_PER_PROGRAM),)
    _fq_kernel[grid](
        xm, out, sat.view(torch.int8) if sat is not None else out, amax_t, n_blocks, row_len,
        per_row, FAMILY=cfg.family.kernel_id,
        VARIANT=1 if cfg.nvfp4_variant == "one_level" else 0,
        RULE=_RULES.get(cfg.scale_rule, 0), IS_FLOAT=elem.kind == "float", EMAX=elem.emax,
        EMIN=elem.emin, MBITS=elem.mbits, INV_STEP=1.0 / elem.step, STEP=elem.step,
        MAX_NORMAL=elem.max_normal, RNA=cfg.rounding == "rna", BLOCK=layout.block,
        BLOCK_P2=triton.next_power_of_2(layout.block), GROUP=BLOCKS_PER_PROGRAM,
        WHOLE_BLOCKS=row_len % layout.block == 0, WANT_SAT=want_sat, OUT_KIND=_DTYPES.index(x.dtype),
        FOS=("none", "mse", "mae").index(cfg.four_over_six), G_RANGE=6.0 * float(cfg.global_bound),
        STAGES=triton.next_power_of_2(layout.block).bit_length() - 1, enable_fp_fusion=False,
    )
    return (out.movedim(-1, layout.axis),
            None if sat is None else sat.movedim(-1, layout.axis))


def quantize(x: torch.Tensor, cfg: QuantConfig, layout: BlockLayout, want_sat: bool,
             exponents: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The kernels' result for a CUDA tensor they cover, else None."""
    if x.device.type != "cuda" or not supported(x, cfg, layout, exponents):
        return None
    return run(x, cfg, layout, want_sat)



FWHT_DTYPES = _DTYPES  # `formats.hadamard.fwht` sends these here on CUDA
FWHT_ELEMENTS = 4096  # elements per program: whole blocks, at least one


@triton.jit
def _fwht_kernel(x_ptr, out_ptr, signs_ptr, n_blocks, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                 STAGES: tl.constexpr, GROUP: tl.constexpr, SIGNS: tl.constexpr,
                 KIND: tl.constexpr):
    """GROUP blocks of BLOCK (= 2^STAGES) contiguous elements per program: the signs, the
    butterflies of `hadamard.butterfly` (stage h: (a + c, a - c) for the pairs h apart, as a
    reshape to [.., 2, h], a split and a join) in registers, then SCALE (fl32(1/sqrt(b)))."""
    pid = tl.program_id(0)
    bid = pid.to(tl.int64) * GROUP + tl.arange(0, GROUP).to(tl.int64)
    k = tl.arange(0, BLOCK)
    offs = bid[:, None] * BLOCK + k[None, :]
    mask = tl.broadcast_to((bid < n_blocks)[:, None], (GROUP, BLOCK))
    if KIND == 1:  # bf16 widened on the bits
        raw = tl.load(x_ptr.to(tl.pointer_type(tl.int16)) + offs, mask=mask, other=0)
        v = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SIGNS:
        v = v * tl.load(signs_ptr + k)[None, :]
    for s in tl.static_range(STAGES):
        h: tl.constexpr = 1 << s
        w = tl.permute(tl.reshape(v, (GROUP, BLOCK // (2 * h), 2, h)), (0, 1, 3, 2))
        lo, hi = tl.split(w)
        w = tl.join(lo + hi, lo - hi)
        v = tl.reshape(tl.permute(w, (0, 1, 3, 2)), (GROUP, BLOCK))
    v = v * SCALE
    if KIND == 0:
        tl.store(out_ptr + offs, v, mask=mask)
    else:
        if KIND == 1:  # round to nearest even on the bits
            bits = v.to(tl.int32, bitcast=True)
            narrow = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
            canon = 0x7FC0
        else:
            narrow = v.to(tl.float16).to(tl.int16, bitcast=True)
            canon = 0x7E00
        narrow = tl.where(v != v, tl.full(v.shape, canon, tl.int16), narrow)
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + offs, narrow, mask=mask)


def fwht(x: torch.Tensor, block_size: int, signs: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`formats.hadamard.fwht` along the last axis on x's device (CUDA, or CPU under
    TRITON_INTERPRET=1): a new tensor of x's shape and dtype, the butterflies' exact bits."""
    xs = x.detach().contiguous()
    out = torch.empty_like(xs)
    n_blocks = xs.numel() // block_size
    group = max(1, FWHT_ELEMENTS // block_size)
    sg = xs.new_zeros(1, dtype=torch.float32) if signs is None else \
        signs.to(device=x.device, dtype=torch.float32).contiguous()
    _fwht_kernel[(triton.cdiv(n_blocks, group),)](
        xs, out, sg, n_blocks, SCALE=scale, BLOCK=block_size,
        STAGES=block_size.bit_length() - 1, GROUP=group, SIGNS=signs is not None,
        KIND=_DTYPES.index(x.dtype), enable_fp_fusion=False,
    )
    return out
