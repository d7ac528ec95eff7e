"""vLLM's NVFP4 KV-cache writers. `nvfp4_variant` "vllm-kv" (vLLM's own, on compute capability
10.x): the order of fp32 operations of
`reshape_and_cache_nvfp4_kernel` (vLLM `csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu`, with
`cvt_warp_fp16_to_fp4` of `quantization/fp4/nvfp4_utils.cuh`), per 16 values along head_dim of
one token and head, with the checkpoint's per-tensor `k_scale` (or `v_scale`) k:

    g      = 1 / k                                   (the kernel's global scale)
    SF     = e4m3(g * (amax_b * (1 / 6)))            (the stored block scale)
    enc    = 1 / (SF * (1 / g)),  0 where SF == 0
    q      = e2m1(x * enc)                           (nearest even, saturating at 6)
    out    = (q * SF) * k

`four_over_six` "mse" is its `nvfp4_4over6` cache: the max/4 candidate (1/4 instead of 1/6) is
kept where its error is smaller, the error of a candidate being the fp32 sum, pair by pair
(`error += dx*dx + dy*dy`, in element order), of dx = e2m1(x * enc) * (1 / enc) - x (the sum of
x^2 when enc is 0); a tie keeps max/6.

The kernel's reciprocals are `rcp.approx.ftz.f32`; here they are correctly rounded (they agree
wherever the approximation is within half an ulp, which PTX does not promise), and its
`dx*dx + dy*dy` may be contracted into FMAs by the CUDA compiler: docs/attention.md says so.
The scale k is a stored scale (`scale=`), else amax_t / 448 (ModelOpt's exported `k_scale`);
0 counts as 1 (only an all-zero tensor has it, and it quantizes to zeros with any scale).

`nvfp4_variant` "flashinfer-kv" (compute capability 8.x, 9.x and 12.x, where vLLM writes with
FlashInfer's `nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`, `nvfp4_append_quantize_block`
in `include/flashinfer/page.cuh`, FlashInfer fb28d72), with the same k:

    SF     = e4m3(amax_b / (6 * k))                  (0 where amax_b is 0)
    enc    = 1 / (SF * k),  0 where SF == 0
    q      = e2m1(x * enc)                           (its threshold table: nearest even, saturating)
    out    = (q * SF) * k

It has no four over six (vLLM refuses `nvfp4_4over6` there). FlashInfer compiles it with fast
math (approximate division and reciprocal); here both are correctly rounded.
"""

from __future__ import annotations

import torch

from qtransform.formats.elements import round_magnitude, round_signed
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import E4M3

ONE_SIXTH = float(torch.tensor(1 / 6, dtype=torch.float32))  # the kernel's 1/6 in fp32


def _candidate(amax_b: torch.Tensor, g: torch.Tensor, inv_g: torch.Tensor,
               factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales SF, encode scales enc) of one candidate (`factor` 1/6 or 1/4)."""
    sf = round_magnitude(g * (amax_b * factor), E4M3)  # E4M3 to nearest even, saturating
    enc = torch.where(sf != 0, torch.reciprocal(sf * inv_g), 0.0)
    return sf, enc


def _error(blocks: torch.Tensor, enc: torch.Tensor, cfg: QuantConfig) -> torch.Tensor:
    """The writer's squared error of each block under `enc`, summed pair by pair in order."""
    dec = torch.where(enc != 0, torch.reciprocal(enc), 0.0)[:, None]
    q = round_signed(torch.clamp(blocks * enc[:, None], -6.0, 6.0), cfg.spec.element, "rne", None)
    d = torch.where(enc[:, None] != 0, q * dec - blocks, blocks)
    sq = d * d
    pairs = sq[:, 0::2] + sq[:, 1::2]
    err = torch.zeros_like(enc)
    for i in range(pairs.shape[1]):
        err = err + pairs[:, i]
    return err


def quantize_vllm_kv(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
                     amax_t: torch.Tensor | None, scale_t: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor | None]:
    """(elements, dequantized values, scaled values, block scales, k, the blocks that kept max/4
    (None without four over six)) of the writer (module docstring) on [n, 16] fp32 blocks."""
    k = (scale_t if scale_t is not None else amax_t / E4M3.max_normal).to(torch.float32)
    k = torch.where(k == 0, 1.0, k)  # an all-zero tensor: any scale gives zeros
    g = torch.reciprocal(k)
    inv_g = torch.reciprocal(g)
    amax_b = blocks.abs().amax(dim=1)
    sf, enc = _candidate(amax_b, g, inv_g, ONE_SIXTH)
    four = None
    if cfg.four_over_six == "mse":
        sf4, enc4 = _candidate(amax_b, g, inv_g, 0.25)
        four = _error(blocks, enc4, cfg) < _error(blocks, enc, cfg)  # a tie keeps max/6
        sf, enc = torch.where(four, sf4, sf), torch.where(four, enc4, enc)
    y = blocks * enc[:, None]
    q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
    return q, (q * sf[:, None]) * (k if k.dim() == 0 else k[:, None]), y, sf, k, four


def quantize_flashinfer_kv(blocks: torch.Tensor, cfg: QuantConfig, u: torch.Tensor | None,
                           amax_t: torch.Tensor | None, scale_t: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """`quantize_vllm_kv`'s tuple for FlashInfer's slot-mapping writer (module docstring)."""
    k = (scale_t if scale_t is not None else amax_t / E4M3.max_normal).to(torch.float32)
    k = torch.where(k == 0, 1.0, k)
    amax_b = blocks.abs().amax(dim=1)
    sf = torch.where(amax_b > 0, round_magnitude(amax_b / (6.0 * k), E4M3), 0.0)
    enc = torch.where(sf > 0, torch.reciprocal(sf * k), 0.0)
    y = blocks * enc[:, None]
    q = round_signed(torch.clamp(y, -6.0, 6.0), cfg.spec.element, cfg.rounding, u)
    return q, (q * sf[:, None]) * (k if k.dim() == 0 else k[:, None]), y, sf, k, None
