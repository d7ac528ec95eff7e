"""Independent ports of each stack's four-over-six block choice, one block at a time in numpy
float32 scalars (every operation rounded to fp32 as the stack's kernel rounds it), for the tests
to compare `four_over_six_order` against. Read from (docs/recipes.md):

- Transformer Engine d0067d0 `common/cast/nvfp4/quantize_4over6_nvfp4.cuh`: `compute_scale_pair`,
  `cvt_fp32_to_fp4_8x_with_error` / `accumulate_dequant_error` (err_use_fast_math off, the default),
  `quantize_stage_rowwise`.
- FlashInfer fb28d72 `csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh`
  `cvt_warp_fp16_to_fp4` (4over6 config, FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1, per-tensor
  scale, 16 elements per thread).
- fouroversix dadfad6 `src/fouroversix/quantize/pytorch/reference.py`: `compute_nv_scale_factors`,
  `fake_quantize_to_e2m1`, `select_fouroversix` (transformers' `FourOverSixConfig` calls it).
- NVIDIA/Model-Optimizer a2fbac7 (`NVFP4_FOUR_OVER_SIX_CFG`): `calib/mse.py` `MseCalibrator`,
  `kernels/quantization/gemm/fp4_kernel.py` `compute_fp4_scales` /
  `static_blockwise_fp4_fake_quant`, `kernels/quantization/common/nvfp4_quant.py`,
  `tensor_quant.py` `_fp8_eager`, `qtensor/nvfp4_tensor.py` (the export).
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3(v: np.float32) -> np.float32:
    """__nv_fp8_e4m3(v) / torch's float8_e4m3fn cast of a value below 464: nearest, ties even."""
    return F32(torch.tensor(float(v), dtype=torch.float32).to(torch.float8_e4m3fn).float().item())


def e2m1_rne(y: np.float32) -> np.float32:
    """cvt.rn.satfinite.e2m1x2.f32: clamp to 6, nearest grid value, ties to the even code."""
    a = min(abs(float(y)), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_GRID[i] - a), i % 2))
    return F32(np.copysign(E2M1_GRID[best], float(y)))


def fouroversix_e2m1(y: np.float32) -> np.float32:
    """fake_quantize_to_e2m1 (nearest): half steps below 2, unit steps below 4, then steps of 2
    with no clamp (torch.round is half to even)."""
    a = abs(float(y))
    if a < 2:
        r = np.round(F32(2) * F32(a)) / F32(2)
    elif a < 4:
        r = np.round(F32(a))
    else:
        r = F32(2) * np.round(F32(a) / F32(2))
    return F32(np.copysign(r, float(y)))


def _enc(amax_t: np.float32, bound: int) -> np.float32:
    """compute_global_encode_scaling_factor_FP4: (B * 6) / amax, capped, 1 for amax 0."""
    if amax_t == 0:
        return F32(1)
    g = min(F32(6 * bound) / amax_t, FLT_MAX)
    return F32(1) if g == 0 else g


def transformer_engine(x: np.ndarray, amax_t: np.float32, bound: int, mode: str) -> tuple[bool, float]:
    """(max/4 kept, chosen E4M3 scale) for one block `x` (fp32) in Transformer Engine's order."""
    with np.errstate(divide="ignore", over="ignore"):  # 1 / 0 is capped, as the kernel's fminf does
        return _transformer_engine(x, amax_t, bound, mode)


def _transformer_engine(x: np.ndarray, amax_t: np.float32, bound: int, mode: str) -> tuple[bool, float]:
    s_enc = _enc(amax_t, bound)
    base = F32(F32(np.abs(x).max()) / F32(6)) * s_enc
    s4 = e4m3(min(base * F32(1.5), F32(448)))
    s6 = e4m3(min(base, F32(448)))
    s_dec = F32(1) / s_enc
    errs = []
    for s in (s4, s6):
        inv = min(F32(1) / (s * s_dec), FLT_MAX)
        err = F32(0)
        for v in x:  # x0[0..7] then x1[0..7] into one accumulator
            q = e2m1_rne(v * inv)
            val = ((q * s) * amax_t) / F32(6 * bound)
            diff = val - v
            err = err + (diff * diff if mode == "mse" else abs(diff))
        errs.append(err)
    four = bool(errs[0] < errs[1])
    return four, float(s4 if four else s6)


def flashinfer(x: np.ndarray, g: np.float32, mode: str) -> tuple[bool, float]:
    """The same for FlashInfer's exact-math per-tensor path; `g` is its SFScaleVal (the global
    encode scale its caller passes)."""
    with np.errstate(divide="ignore", over="ignore"):
        return _flashinfer(x, g, mode)


def _flashinfer(x: np.ndarray, g: np.float32, mode: str) -> tuple[bool, float]:
    vmax = F32(np.abs(x).max())
    if vmax == 0:
        return False, 0.0
    s6_hp = (vmax / F32(6)) * g
    s4_hp = s6_hp * F32(1.5)
    s4, s6 = e4m3(min(s4_hp, F32(448))), e4m3(min(s6_hp, F32(448)))  # satfinite
    gds = F32(1) / g
    errs = []
    for s in (s4, s6):
        out_scale = min(F32(1) / (s * gds), FLT_MAX)
        err = F32(0)
        for v in x:
            q = e2m1_rne(v * out_scale)
            diff = ((q * s) * gds) - v
            err = err + (diff * diff if mode == "mse" else abs(diff))
        errs.append(err)
    four = bool(errs[0] < errs[1])
    return four, float(s4 if four else s6)


def fouroversix(blocks: np.ndarray, amax_t: np.float32, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(max/4 kept, chosen scale) per row of `blocks` [n, 16] in the fouroversix reference's
    order (its 256 bound); the error sums are torch's `.sum(axis=-1)` of the [n, 16] fp32 terms,
    as the reference computes them."""
    n, width = blocks.shape
    terms = {4: np.zeros((n, width), np.float32), 6: np.zeros((n, width), np.float32)}
    scales = {4: np.zeros(n, np.float32), 6: np.zeros(n, np.float32)}
    enc = F32(1536) / amax_t
    decode = F32(1) / enc
    for r in range(n):
        hp = F32(F32(np.abs(blocks[r]).max()) / F32(6)) * enc
        for m, s_hp in ((6, hp), (4, hp * F32(1.5))):
            s = e4m3(s_hp)
            scales[m][r] = s
            for i, v in enumerate(blocks[r]):
                y = v * (F32(1) / (decode * s)) if s != 0 else F32(0)
                dq = ((fouroversix_e2m1(y) * s) * amax_t) / F32(1536)
                diff = dq - v
                terms[m][r, i] = diff * diff if mode == "mse" else abs(diff)
    e4 = torch.from_numpy(terms[4]).sum(axis=-1).numpy()
    e6 = torch.from_numpy(terms[6]).sum(axis=-1).numpy()
    four = e4 < e6
    return four, np.where(four, scales[4], scales[6])


def pairwise(x: np.ndarray, amax_t: np.float32, bound: int, mode: str) -> tuple[bool, float]:
    """The same for qtransform's own order (docs/numerics.md "Four over six"): scales
    amax_b * (g * fl(1/6)) and * (g * 0.25), values q * (s * d), the halving sum."""
    with np.errstate(divide="ignore", over="ignore"):
        g = _enc(amax_t, bound)
        d = F32(1) / g
        amax_b = F32(np.abs(x).max())
        s6 = e4m3(min(amax_b * (g * F32(1 / 6)), FLT_MAX))
        s4 = e4m3(min(amax_b * (g * F32(0.25)), FLT_MAX))
        errs = []
        for s in (s6, s4):
            sd = s * d
            enc = min(F32(1) / sd, FLT_MAX)
            t = [(lambda e: e * e if mode == "mse" else abs(e))(e2m1_rne(v * enc) * sd - v) for v in x]
            t += [F32(0)] * ((1 << max(len(t) - 1, 0).bit_length()) - len(t))
            while len(t) > 1:
                h = len(t) // 2
                t = [t[i] + t[i + h] for i in range(h)]
            errs.append(t[0])
    four = bool(errs[1] < errs[0])
    return four, float(s4 if four else s6)


def elements(x: np.ndarray, scale: float, d: np.float32) -> list[float]:
    """A block's E2M1 values under its chosen E4M3 scale in NVIDIA's order: x * (1 / (s * d))
    rounded to nearest even, clamped to 6 (signed; a negative value rounded to 0 is -0)."""
    with np.errstate(divide="ignore", over="ignore"):
        enc = min(F32(1) / (F32(scale) * d), FLT_MAX)
    return [float(e2m1_rne(v * enc)) for v in x]


def packed_nvfp4(elements: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes a byte, the first element in the low nibble (what every stack writes),
    from fp32 values on the E2M1 grid (signed; -0 keeps its sign bit)."""
    codes = []
    for v in elements.reshape(-1).tolist():
        mag = E2M1_GRID.index(abs(v))
        codes.append(mag | (8 if np.signbit(v) else 0))
    c = torch.tensor(codes, dtype=torch.uint8).reshape(elements.shape[0], -1)
    return c[:, 0::2] | (c[:, 1::2] << 4)


# --- ModelOpt's NVFP4_FOUR_OVER_SIX_CFG (NVIDIA/Model-Optimizer a2fbac7) ---------------------------

def _halving_sum(terms: list[np.float32]) -> np.float32:
    """t[i] += t[i + h] for h = 8, 4, 2, 1 on 16 fp32 terms."""
    t = [F32(v) for v in terms]
    while len(t) > 1:
        h = len(t) // 2
        t = [F32(t[i] + t[i + h]) for i in range(h)]
    return t[0]


def modelopt_fake_quant(x: np.ndarray, amax: np.float32, g_amax: np.float32) -> list[np.float32]:
    """static_blockwise_fp4_fake_quant of one block with block amax `amax` and global amax
    `g_amax`, four_over_six's normalization 256: compute_fp4_scales (amax / 6, then fp8 fake
    quantization against (G * (448 / 256)) / 6: x * (448 / A) to E4M3, saturating, times the
    reciprocal) and the kernel's |x| / scale rounded to the E2M1 grid, ties even, signed back."""
    a = F32(F32(g_amax * F32(1.75)) / F32(6))
    if a <= F32(2.0**-24):
        a = F32(1)
    enc = F32(F32(448) / a)
    dec = F32(F32(1) / enc)
    scale = F32(e4m3(min(F32(F32(amax / F32(6)) * enc), F32(448))) * dec)
    if scale == 0:
        return [F32(0)] * len(x)
    out = []
    for v in x:
        m = F32(e2m1_rne(F32(abs(v)) / scale)) * scale
        out.append(F32(m if v >= 0 else -m))
    return out


def modelopt_calibrated_amax(x: np.ndarray, g_amax: np.float32) -> tuple[bool, np.float32]:
    """(1.5 chosen, calibrated block amax): MseCalibrator over the multipliers 1.0 and 1.5 of the
    block's max-calibrated amax, loss (x - xq)^2 per element summed over the block, argmin (a tie
    keeps the first, 1.0)."""
    amax = F32(np.abs(x).max())
    losses = []
    for a in (amax, F32(amax * F32(1.5))):
        xq = modelopt_fake_quant(x, a, g_amax)
        losses.append(_halving_sum([F32(F32(v - q) * F32(v - q)) for v, q in zip(x, xq, strict=True)]))
    four = bool(losses[1] < losses[0])
    return four, F32(amax * F32(1.5)) if four else amax


def modelopt_export(x: np.ndarray, amax_c: np.float32, g_amax: np.float32) -> tuple[list[float], float, np.float32]:
    """(E2M1 values, E4M3 block scale, weight_scale_2) ModelOpt's export writes for one block:
    weight_scale_2 = G / (6 * 256), weight_scale = e4m3(clamp((amax_c / 6) * 256 / (G / 6), 2^-9,
    448)) with amax_c / 6 == 0 taken as 1, elements x / (weight_scale * weight_scale_2) rounded to
    nearest even, saturating at 6 (a negative value rounded to zero is -0: its sign bit)."""
    d = F32(g_amax / F32(1536))
    p = F32(amax_c / F32(6))
    p = F32(1) if p == 0 else p
    v = F32(F32(p * F32(256)) / F32(g_amax / F32(6)))
    s = e4m3(min(max(v, F32(2.0**-9)), F32(448)))
    sd = F32(s * d)
    return [float(e2m1_rne(F32(v / sd))) for v in x], float(s), d


def modelopt_four_over_six(x: np.ndarray, g_amax: np.float32) -> tuple[bool, list[float], float, np.float32]:
    """One weight block of NVFP4_FOUR_OVER_SIX_CFG as the export stores it: (1.5 chosen, E2M1
    values, E4M3 scale, weight_scale_2)."""
    four, amax_c = modelopt_calibrated_amax(x, g_amax)
    return (four, *modelopt_export(x, amax_c, g_amax))
