"""A teammate's independent plain-torch port (test oracle) of what vLLM 0.32.0 + FlashInfer 0.6.18
compute when they READ an NVFP4 KV cache (``kv_cache_dtype`` "nvfp4" / "nvfp4_4over6").

Written from source only (nothing here ran on a GPU); docs/attention.md lists the
sources.  Three readers exist:

``path="fa2"``        FlashInfer FA2 paged-prefill template (prefill on SM80/86/89/90/120/121,
                      decode on SM80/86/89/90 through BatchDecodeWithPagedKVCacheWrapper with
                      use_tensor_cores=True, which runs the same batch-prefill module).
``path="xqa"``        FlashInfer XQA ``csrc/xqa/mha.cu`` built with CACHE_ELEM_ENUM=3
                      (decode on SM120/121 only).
``path="trtllm_gen"`` trtllm-gen FMHA cubins (prefill and decode on SM100/103).  CLOSED
                      binaries: only the host-side contract is certain; the inner
                      steps are inferred and exposed as options.

Every rounding step can be switched off (``exact=True``); the result then equals plain
attention (``sdpa_decoded``) on the decoded cache ``code * SF * global_scale``.

Cache inputs (one layer, one sequence, already gathered from the pages):
    k_codes, v_codes : int tensor [T_kv, H_kv, D], E2M1 codes 0..15 (bit 3 = sign)
    k_sf, v_sf       : float tensor [T_kv, H_kv, D//16], the E4M3 block scales as values
    k_scale, v_scale : python floats, the per-tensor decode scales vLLM holds as
                       layer._k_scale_float / _v_scale_float (1.0 without a checkpoint scale)
Query: q [T_q, H_q, D] (fp32 or the model dtype); query i sits at absolute position
T_kv - T_q + i (vLLM's causal convention: the new tokens are already in the cache).
"""
from __future__ import annotations

import math

import torch

E2M1_MAG = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- helpers
def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 code (0..15) -> its value, fp32."""
    codes = codes.long()
    mag = E2M1_MAG.to(codes.device)[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def rnd(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Round an fp32 tensor to ``dtype`` (RNE) and back; None = no rounding."""
    if dtype is None:
        return x
    if dtype == torch.float8_e4m3fn:  # cvt.rn.satfinite: saturate to +-448
        return x.clamp(-E4M3_MAX, E4M3_MAX).to(dtype).to(torch.float32)
    return x.to(dtype).to(torch.float32)


def decode_cache(codes, sf, g):
    """NVFP4 cache -> fp32 values  code * SF * g  (the writer's contract)."""
    v = e2m1_values(codes)
    T, H, D = v.shape
    return (v.view(T, H, D // 16, 16) * sf.float().unsqueeze(-1)).view(T, H, D) * g


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def _gqa(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[T, H_kv, D] -> [H_q, T, D] (query head h reads kv head h // (H_q / H_kv))."""
    return x.repeat_interleave(hq // x.shape[1], dim=1).transpose(0, 1)


def _mask(tq: int, tkv: int, causal: bool, device) -> torch.Tensor:
    """Boolean [T_q, T_kv], True = visible."""
    if not causal:
        return torch.ones(tq, tkv, dtype=torch.bool, device=device)
    qpos = torch.arange(tkv - tq, tkv, device=device).unsqueeze(1)
    return torch.arange(tkv, device=device).unsqueeze(0) <= qpos


# ----------------------------------------------------------------------------- oracle
def sdpa_decoded(q, k_codes, k_sf, k_scale, v_codes, v_sf, v_scale, *,
                 sm_scale=None, causal=True, dtype=torch.float64):
    """Unrounded attention on the decoded cache (float64 by default)."""
    D = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    K = _gqa(decode_cache(k_codes, k_sf, k_scale), q.shape[1]).to(dtype)
    V = _gqa(decode_cache(v_codes, v_sf, v_scale), q.shape[1]).to(dtype)
    Q = q.to(dtype).transpose(0, 1)
    s = Q @ K.transpose(-1, -2) * sm_scale
    s = s.masked_fill(~_mask(q.shape[0], K.shape[1], causal, q.device), float("-inf"))
    return (torch.softmax(s, -1) @ V).transpose(0, 1)


# ----------------------------------------------------------------------------- fa2
def fa2_reader(q, k_codes, k_sf, k_scale, v_codes, v_sf, v_scale, *, sm_scale=None,
               causal=True, model_dtype=torch.bfloat16, kv_tile=None, exact=False):
    """FlashInfer FA2 template with NVFP4 KV (include/flashinfer/attention/prefill.cuh).

    Steps (C = certain from source, I = inferred / modelled):
    1. (C) q stays in the model dtype (vLLM passes q_scale=1.0 for fa2 NVFP4).
    2. (C) K~ = dtype(code) * dtype(SF) with __hmul2 in the model dtype: exact, because
       |code*SF| <= 2688 and it needs <= 6 significant bits (bf16 has 8, fp16 11).
    3. (C) S = q . K~ on m16n16k16 f16/bf16 MMAs, fp32 accumulation (summation order
       of the MMA is not modelled: fp32 matmul).  k_scale is NOT applied to K: the
       wrapper folds it into sm_scale (sm_scale * q_scale * k_scale, fp32 at the kernel).
    4. (C) online softmax in fp32: p = exp2(S*c - m*c), c = fp32(sm_scale*k_scale)*log2e,
       m = running row max over the KV tiles processed so far (ex2.approx modelled as exp2).
    5. (C) p rounded to the model dtype before P.V (vec_cast<DTypeQ,float>).
    6. (C) the denominator d sums the ROUNDED p (m16k16_rowsum_f16f16f32, fp32 accumulate).
    7. (C) V~ = dtype(code) * dtype(SF) exact, acc_o += p_r . V~ fp32; o, d rescaled in fp32 by
       exp2(m_prev*c - m_new*c) when the max grows.
    8. (C) out = model_dtype(acc_o * rcp(d)) (ptx_rcp modelled as 1/d).
    9. (C) if v_scale != 1.0: out = model_dtype(out * v_scale) -- a second rounding,
       done by the Python wrapper after the kernel (``out *= v_scale``).
    kv_tile: KV tile length of the online softmax (None = one tile, i.e. p rounded
    relative to the final row max).  The real CTA_TILE_KV is picked by the kernel
    dispatch (16*NUM_MMA_KV*NUM_WARPS_KV) and split-KV is forced off for NVFP4; it only
    changes which max p is rounded against (I).
    """
    D = q.shape[-1]
    hq = q.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    pd = None if exact else model_dtype
    Q = rnd(q.float(), pd).transpose(0, 1)                      # [Hq, Tq, D]
    Kt = _gqa(decode_cache(k_codes, k_sf, 1.0), hq)             # code*SF, exact in dtype
    Vt = _gqa(decode_cache(v_codes, v_sf, 1.0), hq)
    if exact:  # fold the global scales back where the oracle has them
        Kt, Vt = Kt * k_scale, Vt * v_scale
        c = sm_scale * LOG2E
    else:
        c = float(torch.tensor(sm_scale * 1.0 * k_scale, dtype=torch.float32)) * LOG2E
        c = float(torch.tensor(c, dtype=torch.float32))
    S = Q @ Kt.transpose(-1, -2)                                # fp32
    vis = _mask(q.shape[0], Kt.shape[1], causal, q.device)
    S = S.masked_fill(~vis, float("-inf"))
    T = Kt.shape[1]
    tile = T if kv_tile is None else kv_tile
    m = torch.full(S.shape[:-1], float("-inf"))
    d = torch.zeros(S.shape[:-1])
    acc_o = torch.zeros(hq, q.shape[0], Vt.shape[-1])
    for t0 in range(0, T, tile):
        s = S[..., t0:t0 + tile]
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        scale = torch.exp2(m * c - m_safe * c)
        scale = torch.where(torch.isinf(m), torch.zeros_like(scale), scale)
        p = torch.exp2(s * c - (m_safe * c).unsqueeze(-1))      # fp32
        p = rnd(p, pd)                                          # step 5
        d = d * scale + p.sum(-1)                               # step 6 (rounded p)
        acc_o = acc_o * scale.unsqueeze(-1) + p @ Vt[:, t0:t0 + tile]
        m = m_new
    out = acc_o * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)).unsqueeze(-1)
    out = rnd(out, pd)                                          # step 8
    if not exact and v_scale != 1.0:
        out = rnd(out * v_scale, pd)                            # step 9
    return out.transpose(0, 1)


# ----------------------------------------------------------------------------- xqa
def xqa_reader(q, k_codes, k_sf, k_scale, v_codes, v_sf, v_scale, *, sm_scale=None,
               causal=True, model_dtype=torch.bfloat16, exact=False,
               cta_tile=256, warp_tile=64, v_tile=32, groups=None):
    """FlashInfer XQA generic kernel (csrc/xqa/mha.cu, CACHE_ELEM_ENUM=3), SM12x decode.

    Host (C): vLLM passes bmm1_scale = scale*k_scale (q not fp8), bmm2_scale = v_scale;
    decode.py:xqa_batch_decode_with_kv_cache turns that into kv_scale = v_scale and
    q_scale = bmm1_scale / v_scale * sqrt(D); the kernel's qkScale = q_scale*kv_scale*
    rsqrtf(D) (= scale*k_scale up to fp32 rounding) multiplies the fp32 Q.K^T accumulator.
    Kernel (C unless marked):
    1. q in the model dtype; K~ = dtype(code) * dtype(SF) (mul.rn.bf16x2/f16x2, exact).
    2. S = q.K~ fp32 accumulate, S *= qkScale (fp32).
    3. per 64-token warp tile: m_w = max(row max known at the start of the 256-token CTA
       tile, tile max) (I: ctaRowMax hand-off modelled as up to date per CTA tile);
       p = exp2(S*log2e - m_w*log2e) fp32; p rounded to the model dtype (toFp16);
       rowsum_w = sum of ROUNDED p (MMA with ones, fp32).
    4. gemm1 merges warp tiles in order: if m_w > G: acc, sum *= exp(G - m_w) fp32;
       if m_w < G: p_r *= dtype(exp(m_w - G)) in the model dtype (second rounding of p),
       rowsum_w *= exp(m_w - G) fp32.
    5. acc += p_r . V~ (fp32), V~ = code*SF exact.
    6. out = acc * (rcp_rn(sum) * v_scale) in fp32 (v_scale fused, one rounding).
    7. head_dim 128: two gemm1 warp groups each own one 32-token half of every 64-token
       tile; each group's normalised output is rounded to the model dtype and the two are
       added in the model dtype (smemFp16ArraySum<false>, __hadd2_rn) (C for the sum;
       the token split by ``idxVTileInsideXIter`` is read, modelled here).  head_dim 256:
       one group.  Multi-block mode (long sequences, few CTAs) adds one more rounding of
       per-block outputs and is NOT modelled.
    """
    D = q.shape[-1]
    hq = q.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if groups is None:
        groups = {128: 2}.get(D, 1)
    pd = None if exact else model_dtype
    Q = rnd(q.float(), pd).transpose(0, 1)
    Kt = _gqa(decode_cache(k_codes, k_sf, 1.0), hq)
    Vt = _gqa(decode_cache(v_codes, v_sf, 1.0), hq)
    if exact:
        Kt, Vt, qk = Kt * k_scale, Vt * v_scale, sm_scale
        vo = 1.0
    else:
        q_scale_value = f32(sm_scale * k_scale / v_scale * math.sqrt(D))
        qk = f32(f32(q_scale_value * f32(v_scale)) * f32(1.0 / math.sqrt(D)))
        vo = f32(v_scale)
    S = (Q @ Kt.transpose(-1, -2)) * qk
    T = Kt.shape[1]
    S = S.masked_fill(~_mask(q.shape[0], T, causal, q.device), float("-inf"))
    shp = S.shape[:-1]
    G = torch.full(shp, float("-inf"))
    tot = torch.zeros(shp)
    acc = torch.zeros(groups, *shp, Vt.shape[-1])
    for c0 in range(0, T, cta_tile):
        init = G.clone()
        for w0 in range(c0, min(c0 + cta_tile, T), warp_tile):
            s = S[..., w0:w0 + warp_tile]
            m_w = torch.maximum(init, s.amax(-1))
            m_ws = torch.where(torch.isinf(m_w), torch.zeros_like(m_w), m_w)
            p = rnd(torch.exp2(s * LOG2E - (m_ws * LOG2E).unsqueeze(-1)), pd)
            rs = p.sum(-1)
            G_new = torch.maximum(G, m_w)
            Gs = torch.where(torch.isinf(G_new), torch.zeros_like(G_new), G_new)
            a_sc = torch.where(torch.isinf(G), torch.zeros_like(G), torch.exp(G - Gs))
            x_sc = torch.where(torch.isinf(m_w), torch.zeros_like(m_w), torch.exp(m_ws - Gs))
            need = m_w < G_new
            p = torch.where(need.unsqueeze(-1), rnd(p * rnd(x_sc, pd).unsqueeze(-1), pd), p)
            rs = torch.where(need, rs * x_sc, rs)
            tot = tot * a_sc + rs
            acc = acc * a_sc.unsqueeze(-1)
            G = G_new
            for t0 in range(w0, min(w0 + warp_tile, T), v_tile):
                g = ((t0 - w0) // v_tile) % groups
                sl = slice(t0 - w0, t0 - w0 + v_tile)
                acc[g] = acc[g] + p[..., sl] @ Vt[:, t0:t0 + v_tile]
    r = torch.where(tot > 0, 1.0 / tot, torch.zeros_like(tot)) * vo
    parts = rnd(acc * r.unsqueeze(-1), pd)
    out = parts[0]
    for g in range(1, groups):
        out = rnd(out + parts[g], pd)
    return out.transpose(0, 1)


# ----------------------------------------------------------------------------- trtllm-gen
def trtllm_gen_reader(q, k_codes, k_sf, k_scale, v_codes, v_sf, v_scale, *, sm_scale=None,
                      causal=True, q_scale=1.0, exact=False, kv_to_e4m3=True,
                      p_dtype=torch.float8_e4m3fn, p_scale=1.0, sum_rounded_p=False,
                      out_dtype=torch.float8_e4m3fn, quantize_q=True):
    """trtllm-gen FMHA (SM100/103), kernel key (dtypeQ, dtypeK, dtypeV, dtypeO) =
    (E4M3, E2M1, E2M1, E4M3).  Closed cubins: host contract (C), inside (I).

    (C) q_fp8 = e4m3(sat(fp32(q) * (1/q_scale)))  -- vLLM Attention.query_quant (QuantFP8,
        static per-tensor, layer._q_scale, 1.0 unless the checkpoint has q_scale).
    (C) scaleSoftmaxLog2 = bmm1_scale*log2e with bmm1_scale = scale*q_scale*k_scale;
        outputScale = bmm2_scale = v_scale; mScaleSfKv = 1.0 (global KV scales live only
        in bmm1/bmm2); the SF tensors are E4M3 per 16 elements along head_dim.
    (C) output written as E4M3 with no output scale (o_scale absent -> bmm2 = v_scale),
        then copied into the model-dtype output (exact widening): out = e4m3(acc_o * v_scale).
    (I) K~, V~ = e4m3(code * SF): host code says K/V are "transformed" to dtypeQ (E4M3)
        before the MMA (kernelParams.h: transformsKv = dtypeK != dtypeQ,
        storeTransformedKvInTmem); code*SF can need 6 significant bits, so this rounds
        (kv_to_e4m3=False keeps it exact).
    (I) S = q_fp8 . K~ fp32 accumulate; softmax in fp32 with exp2.
    (I) P rounded to e4m3 for the FP8 BMM2 (V~ is e4m3 and the MMA takes 8-bit operands);
        any internal scale applied to P before the cast is unknown (p_scale).
    (I) whether the denominator sums rounded or unrounded P is unknown (sum_rounded_p).
    """
    D = q.shape[-1]
    hq = q.shape[1]
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    e4 = None if exact else torch.float8_e4m3fn
    Q = rnd(q.float() * (1.0 / q_scale), e4 if quantize_q else None).transpose(0, 1)
    Kt = _gqa(decode_cache(k_codes, k_sf, 1.0), hq)
    Vt = _gqa(decode_cache(v_codes, v_sf, 1.0), hq)
    if kv_to_e4m3 and not exact:
        Kt, Vt = rnd(Kt, e4), rnd(Vt, e4)
    bmm1 = sm_scale * q_scale * k_scale
    S = (Q @ Kt.transpose(-1, -2)) * bmm1
    S = S.masked_fill(~_mask(q.shape[0], Kt.shape[1], causal, q.device), float("-inf"))
    m = S.amax(-1, keepdim=True)
    p = torch.exp2((S - m) * LOG2E)
    pr = p if exact or p_dtype is None else rnd(p * p_scale, p_dtype) / p_scale
    d = (pr if sum_rounded_p else p).sum(-1, keepdim=True)
    out = (pr @ Vt) / d * v_scale
    if not exact and out_dtype is not None:
        out = rnd(out, out_dtype)
    return out.transpose(0, 1)


READERS = {"fa2": fa2_reader, "xqa": xqa_reader, "trtllm_gen": trtllm_gen_reader}
