"""Independent plain-torch models of what the training stacks compute in the three GEMMs of a Linear
(no qtransform code): the references the training presets are tested against (docs/training.md).

- Transformer Engine's `NVFP4BlockScaling` (TE main d0067d0,
  `transformer_engine/common/recipe/__init__.py` and the Python reference quantizer
  `transformer_engine/pytorch/custom_recipes/reference_nvfp4.py`): E2M1 elements, E4M3 block scales
  and one fp32 tensor scale per quantized copy; weights in 16x16 tiles (one copy serves both
  orientations), activations and gradients in 1x16 blocks along each GEMM's reduction axis; the
  wgrad operands (the columnwise copies of X and G) rotated by TE's fixed-sign 16x16 Hadamard
  before quantization, with the copy's tensor scale taken from the rotated tensor; stochastic
  rounding on both copies of G.
- torchao's emulated MXFP8 training (`torchao/prototype/moe_training/mxfp8_linear.py`, `mx_mm`):
  every operand quantized from its high-precision tensor along the reduction axis of the GEMM it
  enters, E4M3 elements, blocks of 32, E8M0 scale `2^ceil(log2(amax / 448))` (RCEIL).

Element rounding follows the repository's contract (shared/NUMERICS.md): nearest-even on the element
grid, stochastic `floor(|y|/step + u) * step` with caller-given draws `u`, and NVFP4's dequantized
value `q * (s_b * d)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_EDGES = ((0.25, 0.5, False), (0.75, 1.0, True), (1.25, 1.5, False), (1.75, 2.0, True),
              (2.5, 3.0, False), (3.5, 4.0, True), (5.0, 6.0, False))
FLT_MAX = torch.finfo(torch.float32).max
# transformer_engine/pytorch/custom_recipes/reference_nvfp4.py, get_wgrad_sign_vector()
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def e2m1_nearest(a: torch.Tensor) -> torch.Tensor:
    """|y| in [0, 6] to the nearest E2M1 magnitude, ties to even (TE's cast_to_fp4x2 thresholds)."""
    out = torch.zeros_like(a)
    for edge, value, inclusive in E2M1_EDGES:
        out = torch.where(a >= edge if inclusive else a > edge, torch.full_like(a, value), out)
    return out


def e2m1_stochastic(a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """|y| in [0, 6] rounded down or up on the E2M1 grid: floor(a/step + u) * step."""
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.clamp(torch.floor(a / step + u) * step, max=6.0)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 to E4M3, nearest even, saturating at 448 (TE clamps, then casts)."""
    return torch.clamp(v, max=448.0).to(torch.float8_e4m3fn).to(torch.float32)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def te_rht(x: torch.Tensor, signs: tuple[int, ...] = TE_RHT_SIGNS) -> torch.Tensor:
    """TE's random Hadamard transform of each 16-block of the last axis: x @ (diag(s) H16 / 4)."""
    h = torch.tensor(signs, dtype=torch.float32)[:, None] * sylvester(16) * (1.0 / 16 ** 0.5)
    return (x.reshape(-1, 16) @ h).reshape(x.shape)


def nvfp4(x: torch.Tensor, tile: tuple[int, int] = (1, 16), u: torch.Tensor | None = None) -> torch.Tensor:
    """TE's NVFP4 quantization of a 2-D fp32 tensor along its last axis, dequantized.

    `tile` (1, 16): one scale per 16 consecutive elements of a row; (16, 16): one per 16x16 tile.
    `u`: uniform draws shaped like x for stochastic rounding (None = nearest even).
    """
    m, n = x.shape
    x = x.to(torch.float32)
    amax_t = x.abs().max()
    g = torch.clamp(torch.tensor(6.0 * 448.0) / amax_t, max=FLT_MAX)
    g = torch.where(g == 0, torch.ones_like(g), g)
    d = 1.0 / g
    if tile == (16, 16):
        amax_b = x.abs().reshape(m // 16, 16, n // 16, 16).amax(dim=(1, 3))
        amax_b = amax_b.repeat_interleave(16, dim=0)  # (m, n/16): each row of a tile shares it
    else:
        amax_b = x.abs().reshape(m, n // 16, 16).amax(dim=-1)
    s = e4m3(torch.clamp(amax_b * (g * torch.reciprocal(torch.tensor(6.0))), max=FLT_MAX))[..., None]
    sd = s * d
    enc = torch.clamp(1.0 / sd, max=FLT_MAX)
    y = torch.clamp(x.reshape(m, n // 16, 16) * enc, -6.0, 6.0)
    a = y.abs()
    q = e2m1_nearest(a) if u is None else e2m1_stochastic(a, u.reshape(a.shape))
    return (torch.sign(y) * q * sd).reshape(m, n)


def mxfp8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP8 E4M3 of a 2-D tensor along its last axis (RCEIL), dequantized in fp32."""
    m, n = x.shape
    blocks = x.to(torch.float32).reshape(m, n // block, block)
    descale = blocks.abs().amax(dim=-1, keepdim=True) / 448.0
    e = torch.where(descale > 0, torch.ceil(torch.log2(descale)), torch.tensor(-127.0)).clamp(-127, 127)
    scale = torch.exp2(e)
    q = torch.clamp(blocks / scale, -448, 448).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * scale).reshape(m, n)


@dataclass(frozen=True)
class TESwitches:
    """NVFP4BlockScaling's switches (its constructor arguments and NVTE_NVFP4_* variables)."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    backward_override: str | None = None  # None, "high_precision", "dequantized"


@dataclass(frozen=True)
class Grads:
    y: torch.Tensor
    dx: torch.Tensor
    dw: torch.Tensor


def te_nvfp4_linear(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, switches: TESwitches = TESwitches(),
                    u_dgrad: torch.Tensor | None = None, u_wgrad: torch.Tensor | None = None,
                    rht_signs: tuple[int, ...] = TE_RHT_SIGNS) -> Grads:
    """Forward and both gradients of y = x @ w.T under NVFP4BlockScaling, fp32 GEMMs.

    x: (tokens, in), w: (out, in), g = dL/dy: (tokens, out). `u_dgrad` (tokens, out) and `u_wgrad`
    (out, tokens) are the stochastic draws of G's two copies (ignored when the switch disables it);
    `rht_signs` the Hadamard's sign vector (TE's own by default).
    """
    w_tile = (1, 16) if switches.disable_2d_quantization else (16, 16)
    xq = nvfp4(x)
    wq = nvfp4(w, w_tile)
    y = xq @ wq.T
    if switches.backward_override == "high_precision":
        return Grads(y, g @ w, g.T @ x)
    if switches.backward_override == "dequantized":
        return Grads(y, g @ wq, g.T @ xq)
    sr = not switches.disable_stochastic_rounding
    g_row = nvfp4(g, u=u_dgrad if sr else None)
    w_col = wq if w_tile == (16, 16) else nvfp4(w.T.contiguous()).T
    dx = g_row @ w_col
    rot = (lambda t: t) if switches.disable_rht else (lambda t: te_rht(t, rht_signs))
    g_col = nvfp4(rot(g.T.contiguous()), u=u_wgrad if sr else None)  # (out, tokens)
    x_col = nvfp4(rot(x.T.contiguous()))  # (in, tokens)
    dw = g_col @ x_col.T
    return Grads(y, dx, dw)


def torchao_mxfp8_linear(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, wgrad_with_hp: bool = False) -> Grads:
    """Forward and both gradients of y = x @ w.T as torchao's emulated MXFP8 training computes them."""
    y = mxfp8(x) @ mxfp8(w).T
    dx = mxfp8(g) @ mxfp8(w.T.contiguous()).T
    dw = g.T @ x if wgrad_with_hp else mxfp8(g.T.contiguous()) @ mxfp8(x.T.contiguous()).T
    return Grads(y, dx, dw)


def torchao_emulated_mxfp8(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, wgrad_with_hp: bool = False) -> Grads:
    """torchao's own emulated MXFP8 Linear (`mx_mm` with KernelPreference.EMULATED and its pure-torch
    casts) run forward and backward on CPU: the stack itself, for the bit-exact tests."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    xl = x.detach().clone().requires_grad_(True)
    wl = w.detach().clone().requires_grad_(True)
    e4m3fn = torch.float8_e4m3fn
    y = mx_mm.apply(xl, wl, e4m3fn, e4m3fn, e4m3fn, 32, KernelPreference.EMULATED,
                    MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
                    ScaleCalculationMode.RCEIL, wgrad_with_hp)
    y.backward(g)
    return Grads(y.detach(), xl.grad, wl.grad)
