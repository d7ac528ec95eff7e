"""NVFP4: E2M1 elements, an E4M3 scale per block of 16 and (two-level) one fp32 scale per tensor.

Four named fp32 orders of operations (`nvfp4_variant`), because the public references round
differently on ties and treat zero and tiny scales differently; see docs/numerics.md.
`four_over_six` (default order, 1D blocks) quantizes every block twice, mapping its amax to 6
and to 4, and keeps the candidate with the smaller reconstruction error (arXiv 2512.02010);
`global_bound` is the E4M3 value the tensor amax maps to (448, or 256 to leave the max/4
candidate's block scale room below 448, as Transformer Engine does). `four_over_six_order`
names whose fp32 details decide near-ties: qtransform's own halving sum ("pairwise") or one
stack's scales, dequantization and summation (`_stack_choice`); "modelopt" (with nvfp4_variant
"modelopt") is ModelOpt's NVFP4_FOUR_OVER_SIX_CFG weights: its MSE calibration's choice of block
amax, then its export's arithmetic (`_modelopt_four_over_six`).
"""

from __future__ import annotations

import dataclasses

import torch

from qtransform.formats.blocking import BlockQuant
from qtransform.formats.elements import CANONICAL_NAN, divide, round_magnitude, round_signed
from qtransform.formats.nvfp4_kv import quantize_flashinfer_kv, quantize_vllm_kv
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import (
    E2M1,
    E4M3,
    ROUNDINGS,
    SCALE_DTYPES,
    SCALE_TORCH_DTYPES,
    Family,
    FormatSpec,
    register,
    register_family,
)

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
GLOBAL_RANGE = 2688.0  # E2M1 max (6) * E4M3 max (448)
ONE_SIXTH = float(torch.tensor(1 / 6, dtype=torch.float32))  # fl32(1/6)
# "default" is NVIDIA's order; "vllm-kv" vLLM's NVFP4 KV-cache writer, "flashinfer-kv" FlashInfer's
# (`nvfp4_kv.py`);
# "quartet-ii" Quartet II's forward kernel (`_quartet_ii`); "vllm" vLLM's activation quantizer
# on CUDA, with FlashInfer's four over six (`_vllm`)
VARIANTS = ("default", "compressed-tensors", "one_level", "modelopt", "vllm-kv", "flashinfer-kv", "quartet-ii",
            "vllm")
FOUR_OVER_SIX = ("none", "mse", "mae")  # none: every block maps its amax to 6
GLOBAL_BOUNDS = ("448", "256")  # the E4M3 value the tensor amax maps to (strings: a choice option)
# whose fp32 details decide four over six (docs/numerics.md "Four over six"; docs/recipes.md)
FOUR_OVER_SIX_ORDERS = ("pairwise", "transformer-engine", "flashinfer", "fouroversix", "modelopt")
MIN_BLOCK_SCALE = 2.0**-9  # ModelOpt clamps block scales up to E4M3's smallest subnormal
FP8_EPSILON = 2.0**-24  # ModelOpt's fake_e4m3fy / fp8_eager treat an amax at or below it as 1

# element values, dequantized values, scaled values (for saturation), block scales, tensor scale
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
# the parts and four over six's choice: the blocks that kept max/4 (None without four over six)
Chosen = tuple[Parts, torch.Tensor | None]


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values to E4M3, ties to even (the default), saturating at 448.

    Inf saturates too, so clamping the input to 448 first changes nothing.
    """
    return round_magnitude(v, E4M3)


def _canonical(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(t), CANONICAL_NAN, t)


def _default(
    blocks: torch.Tensor, amax_t: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None
) -> Chosen:
    """NVIDIA's reference order (NVFP4 pretraining paper, App. B), with `four_over_six`'s
    choice between the max/6 and max/4 block scales."""
    g = torch.clamp_max(amax_t.new_tensor(6.0 * float(cfg.global_bound)) / amax_t, FLT_MAX)
    g = torch.where(g == 0, 1.0, g)
    d = 1.0 / g
    amax_b = blocks.abs().amax(dim=1)
    # NUMERICS.md's clamp to [-448, 448] is e4m3_rne's own saturation (the product is >= 0)
    s = e4m3_rne(torch.clamp_max(amax_b * (g * ONE_SIXTH), FLT_MAX))
    q, out, y = _candidate(blocks, s, d, cfg, u)
    if cfg.four_over_six == "none":
        return (q, out, y, s, d), None
    if cfg.four_over_six_order != "pairwise":
        return _stack_choice(blocks, amax_t, g, d, amax_b, cfg)
    s4 = e4m3_rne(torch.clamp_max(amax_b * (g * 0.25), FLT_MAX))
    q4, out4, y4 = _candidate(blocks, s4, d, cfg, u)
    four = (block_error(out4, blocks, cfg.four_over_six)
            < block_error(out, blocks, cfg.four_over_six))  # a tie (or NaN) keeps max/6
    return _pick(four, (q, out, y, s), (q4, out4, y4, s4), d), four


def _pick(four: torch.Tensor, six_parts: tuple[torch.Tensor, ...], four_parts: tuple[torch.Tensor, ...],
          d: torch.Tensor) -> Parts:
    """The max/4 candidate's parts where `four`, else the max/6 candidate's."""
    q, out, y, s = six_parts
    q4, out4, y4, s4 = four_parts
    pick = four[:, None]
    return (torch.where(pick, q4, q), torch.where(pick, out4, out), torch.where(pick, y4, y),
            torch.where(four, s4, s), d)


def _stack_choice(blocks: torch.Tensor, amax_t: torch.Tensor, g: torch.Tensor, d: torch.Tensor,
                  amax_b: torch.Tensor, cfg: QuantConfig) -> Chosen:
    """Four over six in one stack's fp32 order (rounding to nearest even, as they all do):
    both scales from `base = (amax_b / 6) * g`, s4 = e4m3(base * 1.5); each candidate's error
    from the stack's own dequantization and summation (docs/numerics.md); a tie keeps max/6."""
    order = cfg.four_over_six_order
    base = torch.clamp_max((amax_b / 6.0) * g, FLT_MAX)
    s6, s4 = e4m3_rne(base), e4m3_rne(torch.clamp_max(base * 1.5, FLT_MAX))
    parts, errors = [], []
    for s in (s6, s4):
        q, out, y = _candidate(blocks, s, d, cfg, None)
        if order == "fouroversix":  # x * (1 / (d * s)), 0 where s is 0; its rounding never clamps
            y = torch.where(s[:, None] == 0, 0.0, blocks * (1.0 / (d * s))[:, None])
            q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, "rne", None)
            wide = 2.0 * torch.round(y.abs() / 2.0)  # what it gives |y| >= 7 (subnormal scales)
            qe = torch.where(y.abs() >= 7.0, torch.copysign(wide, y), q)
        else:
            qe = q
        qs = qe * s[:, None]  # exact: an E2M1 value times an E4M3 value
        if order == "flashinfer":  # its per-tensor path: (q * s) * (1 / g)
            deq = qs * d
        else:  # Transformer Engine and fouroversix: ((q * s) * amax_t) / (6 * B)
            deq = (qs * amax_t) / (6.0 * float(cfg.global_bound))
        diff = deq - blocks
        t = diff.abs() if cfg.four_over_six == "mae" else diff * diff
        if order == "fouroversix":  # torch's own sum over the last axis, as its reference calls it
            err = t.sum(dim=1)
        else:  # one fp32 accumulator, elements in order
            err = t[:, 0].clone()
            for i in range(1, t.shape[1]):
                err = err + t[:, i]
        parts.append((q, out, y, s))
        errors.append(err)
    four = errors[1] < errors[0]
    return _pick(four, parts[0], parts[1], d), four


def _vllm(blocks: torch.Tensor, amax_t: torch.Tensor | None, cfg: QuantConfig, u: torch.Tensor | None,
          scale_t: torch.Tensor | None) -> Chosen:
    """vLLM's NVFP4 activation quantizer on CUDA (`scaled_fp4_quant`; FlashInfer's
    `nvfp4_quantize` where vLLM calls it), TensorRT-LLM's `cvt_warp_fp16_to_fp4`, with the global
    scale g given (`scale_t`: compressed-tensors' stored input_global_scale, which vLLM passes as
    it is) or 2688 / amax_t:

        SF = e4m3(g * (amax_b * fl(1/6))),  enc = 1 / (SF * fl(1/g)) (0 where SF is 0),
        q = e2m1(x * enc),  out = (q * SF) * fl(1/g)

    with correctly rounded reciprocals (the kernels' `rcp.approx.ftz` agree wherever the
    approximation is within half an ulp). `four_over_six` is FlashInfer's
    (`FLASHINFER_NVFP4_4OVER6`, its error mode): its scales, dequantization and in-order sum
    (`_stack_choice`, order "flashinfer")."""
    if scale_t is not None:
        g = scale_t.to(torch.float32)
    else:
        assert amax_t is not None
        g = torch.clamp_max(amax_t.new_tensor(GLOBAL_RANGE) / amax_t, FLT_MAX)
        g = torch.where(g == 0, 1.0, g)
    d = 1.0 / g
    amax_b = blocks.abs().amax(dim=1)
    dd = d if d.dim() == 0 else d[:, None]
    if cfg.four_over_six != "none":  # decoded as the GEMM reads it: (q * SF) * fl(1/g)
        (q, _, y, s, _), four = _stack_choice(blocks, amax_t, g, d, amax_b,
                                               dataclasses.replace(cfg, four_over_six_order="flashinfer"))
        return (q, (q * s[:, None]) * dd, y, s, d), four
    s = e4m3_rne(torch.clamp_max(g * (amax_b * ONE_SIXTH), FLT_MAX))
    enc = torch.where(s != 0, torch.reciprocal(s * d), 0.0)
    y = blocks * enc[:, None]
    q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
    return (q, (q * s[:, None]) * dd, y, s, d), None


def _candidate(blocks: torch.Tensor, s: torch.Tensor, d: torch.Tensor, cfg: QuantConfig,
               u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elements, dequantized values and scaled values of the blocks under block scales `s`."""
    sd = (s * d)[:, None]
    enc = torch.clamp_max(1.0 / sd, FLT_MAX)
    y = blocks * enc
    q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
    return q, q * sd, y


def block_error(out: torch.Tensor, blocks: torch.Tensor, mode: str) -> torch.Tensor:
    """Each block's reconstruction error in fp32: the terms |out - x| ("mae") or (out - x)^2
    ("mse"), each rounded to fp32, summed by halving: the row is zero-padded to a power of two
    P, then t[i] += t[i + h] for h = P/2, P/4, ..., 1 (docs/numerics.md)."""
    diff = out - blocks
    t = diff.abs() if mode == "mae" else diff * diff
    width = t.shape[1]
    p2 = 1 << max(width - 1, 0).bit_length()
    if p2 != width:
        t = torch.nn.functional.pad(t, (0, p2 - width))
    while t.shape[1] > 1:
        h = t.shape[1] // 2
        t = t[:, :h] + t[:, h:]
    return t[:, 0]


def _compressed_tensors(
    blocks: torch.Tensor, amax_t: torch.Tensor | None, cfg: QuantConfig, u: torch.Tensor | None,
    scale_t: torch.Tensor | None = None,
) -> Parts:
    """compressed-tensors / llm-compressor order: scale = e4m3(g * amax_b / 6) / g, x / scale.

    With a bf16/fp16 `scale_dtype` (compressed-tensors on a model of that dtype) the two
    divisions `2688 / amax_t` and `amax_b / 6` are that dtype's divisions, as its observers
    compute them on the model's own tensors; the rest stays fp32. A stored `scale_t` is the
    global scale g itself (a checkpoint's `input_global_scale`), used as compressed-tensors'
    forward uses it: an fp32 factor, however it was rounded when it was made."""
    dtype = SCALE_TORCH_DTYPES[cfg.scale_dtype]
    amax_b = blocks.abs().amax(dim=1)
    if dtype == torch.float32:
        sixth = divide(amax_b, 6.0)
    else:  # the amaxes of a `dtype` tensor are `dtype` values: the casts in are exact
        sixth = (amax_b.to(dtype) / 6.0).to(torch.float32)
    if scale_t is not None:
        g = scale_t
    elif dtype == torch.float32:
        assert amax_t is not None
        g = amax_t.reciprocal() * GLOBAL_RANGE  # Python's `2688 / tensor` computes exactly this
    else:
        assert amax_t is not None
        g = (GLOBAL_RANGE / amax_t.to(dtype)).to(torch.float32)
    g = torch.where(torch.isfinite(g), g, 1.0)  # amax 0, NaN, or so tiny that g overflows
    s = e4m3_rne(g * sixth)  # clamped to 448 by e4m3_rne itself
    s = torch.where(s == 0, 0.125, s)
    scale = (s / g)[:, None]
    y = blocks / scale
    qa = round_magnitude(torch.clamp(y, -6.0, 6.0).abs(), cfg.spec.element, cfg.rounding, u)
    q = torch.where(y < 0, -qa, qa)  # the sign of an exact zero is lost (-0 becomes +0)
    return q, q * scale, y, s, g


def _modelopt(
    blocks: torch.Tensor, amax_t: torch.Tensor | None, cfg: QuantConfig, u: torch.Tensor | None,
    scale_t: torch.Tensor | None = None,
) -> Parts:
    """ModelOpt's export (`NVFP4QTensor`, what its checkpoints hold): d = amax / 2688 (a true
    division: `weight_scale_2`), s = e4m3(clamp(amax_b / (6 d), 2^-9, 448)) with a zero block's
    s = 1, elements x / (s d); zeros come out +0 (its E2M1 table). A zero or infinite tensor
    amax takes d = 1 (ModelOpt would divide by zero). A stored `scale_t` is d itself (a
    checkpoint's `input_scale`)."""
    d = amax_t / GLOBAL_RANGE if scale_t is None else scale_t
    d = torch.where((d == 0) | torch.isinf(d), 1.0, d)
    s = blocks.abs().amax(dim=1) / (6.0 * d)
    s = e4m3_rne(torch.clamp(torch.where(s == 0, 1.0, s), MIN_BLOCK_SCALE, E4M3_MAX))
    sd = (s * d)[:, None]
    y = blocks / sd
    qa = round_magnitude(torch.clamp(y, -6.0, 6.0).abs(), cfg.spec.element, cfg.rounding, u)
    q = torch.where(qa == 0, 0.0, torch.where(y < 0, -qa, qa))  # its zeros are +0
    return q, q * sd, y, s, d


def _modelopt_four_over_six(blocks: torch.Tensor, amax_t: torch.Tensor) -> tuple[Parts, torch.Tensor]:
    """ModelOpt's NVFP4_FOUR_OVER_SIX_CFG weight, as its export stores it (G = amax_t, the
    group's global amax; NVIDIA/Model-Optimizer a2fbac7, docs/recipes.md).

    Calibration (`MseCalibrator`, multipliers 1.0 and 1.5): each candidate block amax a is
    fake-quantized as `compute_fp4_scales` + the Triton kernel do it: A = (G * 1.75) / 6,
    block scale e4m3((a / 6) * (448 / A)) * (1 / (448 / A)) with no lower clamp (0: a zero
    block), elements |x| / scale rounded to nearest even, signed back; the loss sums
    (x - xq)^2 per block (here by halving, `block_error`); a tie keeps 1.0. Export
    (`NVFP4QTensor`, four_over_six's 256): d = G / 1536, s = e4m3(clamp(((a / 6) * 256) / (G / 6),
    2^-9, 448)) with a zero a / 6 taken as 1, elements x / (s * d); zeros come out +0.
    Also returns which blocks took the 1.5 multiplier (the max/4 choice)."""
    amax_b = blocks.abs().amax(dim=1)
    a15 = amax_b * 1.5
    fq_amax = (amax_t * 1.75) / 6.0
    fq_amax = torch.where(fq_amax <= FP8_EPSILON, 1.0, fq_amax)
    enc = 448.0 / fq_amax
    dec = 1.0 / enc
    errors = []
    for a in (amax_b, a15):
        scale = (e4m3_rne(torch.clamp_max((a / 6.0) * enc, FLT_MAX)) * dec)[:, None]
        qa = round_magnitude(torch.clamp_max(blocks.abs() / torch.where(scale == 0, 1.0, scale), 6.0), E2M1)
        v = qa * scale
        xq = torch.where(scale == 0, 0.0, torch.where(blocks >= 0, v, -v))
        errors.append(block_error(xq, blocks, "mse"))
    four = errors[1] < errors[0]
    amax_c = torch.where(four, a15, amax_b)
    d = amax_t / 1536.0
    sixth = amax_c / 6.0
    s = (torch.where(sixth == 0, 1.0, sixth) * 256.0) / (amax_t / 6.0)
    s = e4m3_rne(torch.clamp(s, MIN_BLOCK_SCALE, E4M3_MAX))
    d = torch.where((d == 0) | torch.isinf(d), 1.0, d)  # ModelOpt would divide by zero
    sd = (s * d)[:, None]
    y = blocks / sd
    qa = round_magnitude(torch.clamp(y, -6.0, 6.0).abs(), E2M1)
    q = torch.where(qa == 0, 0.0, torch.where(y < 0, -qa, qa))  # its zeros are +0
    return (q, q * sd, y, s, d), four


def _quartet_ii(blocks: torch.Tensor, amax_t: torch.Tensor, cfg: QuantConfig,
                u: torch.Tensor | None) -> Chosen:
    """Quartet II's forward (`rtn_1x16s_fp4_kernel_wrapper`, IST-DASLab/Quartet-II 8776a90): d =
    (amax_t / B) / 6 (1 when amax_t is 0; B = global_bound), s = e4m3((amax_b / 6) / d) with a
    zero s taken as 1, y = x / (s * d), out = q * (s * d); four over six ("mse") builds the
    max/4 scale as e4m3(((amax_b / 6) * 1.5) / d) the same way and keeps it where torch's sum
    of the squared errors over the block is smaller (a tie keeps max/6)."""
    bound = float(cfg.global_bound)
    d = torch.where(amax_t == 0, 1.0, (amax_t / bound) / 6.0)
    sixth = blocks.abs().amax(dim=1) / 6.0

    def candidate(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = e4m3_rne(torch.clamp_max(v / d, FLT_MAX))
        s = torch.where(s == 0, 1.0, s)
        sd = (s * d)[:, None]
        y = blocks / sd
        q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
        return q, q * sd, y, s

    six = candidate(sixth)
    if cfg.four_over_six == "none":
        return (*six, d), None
    four_parts = candidate(sixth * 1.5)
    err6 = ((blocks - six[1]) * (blocks - six[1])).sum(dim=1)
    err4 = ((blocks - four_parts[1]) * (blocks - four_parts[1])).sum(dim=1)
    four = err4 < err6
    return _pick(four, six, four_parts, d), four


def _one_level(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None) -> Parts:
    """No tensor scale: s = e4m3(amax_b / 6), elements x / s (torchao's order, no lower clamp)."""
    amax_b = blocks.abs().amax(dim=1)
    s = e4m3_rne(torch.clamp_max(divide(amax_b, 6.0), E4M3_MAX))
    sb = s[:, None]
    y = torch.where(sb == 0, blocks * 0.0, blocks / sb)  # x / 0 is discarded
    q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
    return q, q * sb, y, s, None


def quantize_nvfp4(
    blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None, amax_t: torch.Tensor | None,
    scale_t: torch.Tensor | None = None,
) -> BlockQuant:
    """Quantize NVFP4 blocks; `amax_t` is the amax of the whole (unpadded) tensor, or `scale_t`
    the stored tensor scale (what `BlockQuant.tensor_scale` holds for the variant: g for
    compressed-tensors, d for ModelOpt), used as it is. NVIDIA's default order encodes with g
    and decodes with d = 1/g, which a stored d does not give back exactly: it takes an amax."""
    four = None
    if cfg.nvfp4_variant == "one_level":
        q, out, y, s, ts = _one_level(blocks, cfg, u)
    elif scale_t is not None and cfg.nvfp4_variant == "default":
        raise ValueError("nvfp4: a stored tensor scale takes nvfp4_variant 'compressed-tensors' "
                         "(g) or 'modelopt' (d); the default order derives both from the amax")
    elif amax_t is None and scale_t is None:
        raise ValueError("two-level NVFP4 needs the amax of the whole tensor")
    elif cfg.nvfp4_variant == "default":
        assert amax_t is not None
        (q, out, y, s, ts), four = _default(blocks, amax_t, cfg, u)
    elif cfg.four_over_six_order == "modelopt":
        if scale_t is not None or amax_t is None:
            raise ValueError("nvfp4: four_over_six_order 'modelopt' calibrates from the tensor amax "
                             "(ModelOpt's static weights), not a stored tensor scale")
        (q, out, y, s, ts), four = _modelopt_four_over_six(blocks, amax_t)
    elif cfg.nvfp4_variant == "modelopt":
        q, out, y, s, ts = _modelopt(blocks, amax_t, cfg, u, scale_t)
    elif cfg.nvfp4_variant == "vllm-kv":
        q, out, y, s, ts, four = quantize_vllm_kv(blocks, cfg, u, amax_t, scale_t)
    elif cfg.nvfp4_variant == "flashinfer-kv":
        q, out, y, s, ts, four = quantize_flashinfer_kv(blocks, cfg, u, amax_t, scale_t)
    elif cfg.nvfp4_variant == "vllm":
        (q, out, y, s, ts), four = _vllm(blocks, amax_t, cfg, u, scale_t)
    elif cfg.nvfp4_variant == "quartet-ii":
        if scale_t is not None:
            raise ValueError("nvfp4: nvfp4_variant 'quartet-ii' computes its tensor scale from the "
                             "amax, not a stored scale")
        (q, out, y, s, ts), four = _quartet_ii(blocks, amax_t, cfg, u)
    else:
        q, out, y, s, ts = _compressed_tensors(blocks, amax_t, cfg, u, scale_t)
    return BlockQuant(
        out=_canonical(out), q=_canonical(q), sat=y.abs() > 6.0, scales=_canonical(s),
        tensor_scale=None if ts is None else _canonical(ts), max4=four,
    )


def scale_values(scales: torch.Tensor, tensor_scale: torch.Tensor | None, cfg: QuantConfig) -> torch.Tensor:
    """Stored block scales -> multipliers: the E4M3 scale times (default, modelopt, the KV writers, vllm) or over
    (compressed-tensors) the tensor scale; one-level scales are the multipliers."""
    if tensor_scale is None or cfg.nvfp4_variant == "one_level":
        return scales
    return scales / tensor_scale if cfg.nvfp4_variant == "compressed-tensors" else scales * tensor_scale


def _check(choices: dict[str, str]) -> str | None:
    if choices["nvfp4_variant"] == "quartet-ii" and choices["four_over_six"] == "mae":
        return "nvfp4_variant 'quartet-ii' chooses four over six by squared error; use 'mse'"
    if choices["nvfp4_variant"] == "quartet-ii" and choices["four_over_six_order"] != "pairwise":
        return "nvfp4_variant 'quartet-ii' has its own four-over-six order; remove four_over_six_order"
    if choices["nvfp4_variant"] == "vllm-kv" and choices["four_over_six"] == "mae":
        return ("nvfp4_variant 'vllm-kv' chooses four over six by squared error only (vLLM's "
                "nvfp4_4over6 cache); use four_over_six 'mse'")
    if choices["nvfp4_variant"] == "flashinfer-kv" and choices["four_over_six"] != "none":
        return ("nvfp4_variant 'flashinfer-kv' has no four over six (vLLM takes nvfp4_4over6 on compute "
                "capability 10.x only, with its own writer 'vllm-kv'); remove four_over_six")
    if choices["nvfp4_variant"] == "vllm-kv" and choices["four_over_six_order"] != "pairwise":
        return ("nvfp4_variant 'vllm-kv' has its own four-over-six order (vLLM's KV-cache writer); "
                "remove four_over_six_order")
    if choices["nvfp4_variant"] == "vllm" and choices["four_over_six_order"] != "pairwise":
        return ("nvfp4_variant 'vllm' chooses four over six in FlashInfer's order (its "
                "FLASHINFER_NVFP4_4OVER6); remove four_over_six_order")
    if choices["nvfp4_variant"] == "vllm" and choices["four_over_six"] != "none" and choices["rounding"] != "rne":
        return (f"FlashInfer's four over six rounds to nearest even; remove rounding "
                f"{choices['rounding']!r} or four_over_six")
    if choices["nvfp4_variant"] == "vllm" and choices["global_bound"] != "448":
        return ("nvfp4_variant 'vllm' takes the global scale the checkpoint stores (or 2688 / amax); "
                "remove global_bound")
    order = choices["four_over_six_order"]
    if (order == "modelopt") != (choices["nvfp4_variant"] == "modelopt" and choices["four_over_six"] != "none"):
        return ("four_over_six_order 'modelopt' is ModelOpt's four over six (NVFP4_FOUR_OVER_SIX_CFG): "
                "set it with nvfp4_variant 'modelopt', four_over_six 'mse' and global_bound 256 together")
    if order == "modelopt" and (choices["four_over_six"] != "mse" or choices["global_bound"] != "256"):
        return ("four_over_six_order 'modelopt' chooses by squared error with block scales normalized "
                "to 256, as ModelOpt's MSE calibration does; set four_over_six 'mse' and global_bound 256")
    if choices["four_over_six"] != "none" and choices["nvfp4_variant"] not in (
            "default", "vllm-kv", "modelopt", "vllm", "quartet-ii"):
        return (f"four_over_six applies to nvfp4_variant 'default' (NVIDIA's order), not "
                f"{choices['nvfp4_variant']!r}; set nvfp4_variant 'default' or remove four_over_six")
    if choices["four_over_six"] != "none" and choices["granularity"] != "block":
        return (f"four_over_six chooses per 1D block; granularity {choices['granularity']!r} "
                "is not one (use block_size, not block_shape)")
    if order != "pairwise" and choices["four_over_six"] == "none":
        return (f"four_over_six_order {order!r} decides four over six; set four_over_six "
                "'mse' or 'mae', or remove four_over_six_order")
    if order != "pairwise" and choices["rounding"] != "rne":
        return (f"four_over_six_order {order!r} rounds to nearest even, as {order} does; "
                f"remove rounding {choices['rounding']!r} or use four_over_six_order 'pairwise'")
    if order == "fouroversix" and choices["global_bound"] != "256":
        return ("four_over_six_order 'fouroversix' maps the tensor amax to 256, as the fouroversix "
                "library does; set global_bound 256")
    if (choices["global_bound"] != "448" and choices["nvfp4_variant"] not in ("default", "quartet-ii")
            and order != "modelopt"):
        return (f"global_bound {choices['global_bound']} applies to nvfp4_variant 'default' or "
                "'quartet-ii'; remove it or set one of them")
    if choices["scale_dtype"] != "float32" and choices["nvfp4_variant"] != "compressed-tensors":
        return (f"scale_dtype {choices['scale_dtype']!r} applies to nvfp4_variant "
                "'compressed-tensors' only (its bf16/fp16 scale divisions); set that variant or "
                "scale_dtype 'float32'")
    return None


NVFP4 = register_family(Family(
    "nvfp4", {"rounding": ROUNDINGS, "nvfp4_variant": VARIANTS, "scale_dtype": SCALE_DTYPES,
              "four_over_six": FOUR_OVER_SIX, "global_bound": GLOBAL_BOUNDS,
              "four_over_six_order": FOUR_OVER_SIX_ORDERS},
    quantize=quantize_nvfp4, scale_values=scale_values,
    per_tensor=lambda cfg: cfg.nvfp4_variant != "one_level", kernel_id=1, check=_check,
    quiet=("scale_dtype", "four_over_six", "global_bound", "four_over_six_order"),
))
register(FormatSpec(
    name="nvfp4", family=NVFP4, element=E2M1, default_block=16, scale="e4m3_fp32", tile=(16, 16),
    onnx_op="NVFP4FakeQuant",
    description="NVIDIA NVFP4: E2M1 elements, E4M3 scale per 16, fp32 scale per tensor",
))
