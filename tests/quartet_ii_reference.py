"""An independent plain-torch port of Quartet II's NVFP4 training Linear (IST-DASLab/Quartet-II at
8776a90, `src/models/quantization/schemes/quartet_2.py` and `quantizers/nvfp4_triton.py`), line by
line from its Triton kernels, written without qtransform's numerics; the only inputs it takes
from outside are the random draws (the rotation's signs and the scale uniforms), which the
reference takes from `torch.randint` and `tl.rand` and the tests take from qtransform's
documented streams.

The reference's Triton kernels compute the same operations; this port fixes their fp32 order to
torch's (matmul for the rotation, `sum` for the EDEN sums)."""

from __future__ import annotations

import scipy.linalg
import torch
import torch.nn.functional as F  # noqa: N812

BACKWARD_SCALE_OVERRIDE = (17 / 16) * 0.93  # Quartet_II_fn.backward_scale_override
GROUP = 16  # Quartet_II_fn.group_size


def hadamard(dim: int) -> torch.Tensor:
    """get_hadamard_matrix(dim, float32): scipy's Sylvester matrix times dim**-0.5."""
    return torch.tensor(scipy.linalg.hadamard(dim) * dim**-0.5, dtype=torch.float32)


def rerotate(h: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """rerotate_hadamard with the draw `signs` (±1): H·diag(signs), "along last dim"."""
    return h * signs[None, :]


def rtn_fp4(x: torch.Tensor) -> torch.Tensor:
    """The kernels' nested `tl.where` thresholds: nearest, ties away from zero, 6 above 5."""
    a = x.abs()
    sign = torch.where(x > 0, 1.0, -1.0)
    mag = torch.where(a >= 5, 6.0, torch.where(a >= 3.5, 4.0, torch.where(a >= 2.5, 3.0, torch.where(
        a >= 1.75, 2.0, torch.where(a >= 1.25, 1.5, torch.where(a >= 0.75, 1.0, torch.where(
            a >= 0.25, 0.5, 0.0)))))))
    return mag * sign


def get_scales(xg: torch.Tensor, amax: torch.Tensor, val_max: float, scales_max: float):
    """nvfp4_triton.get_scales: (E4M3 block scales, fp32 tensor scale s_dec)."""
    s_dec = torch.where(amax == 0.0, 1.0, amax / scales_max / val_max)
    s_dec_b = xg.abs().amax(dim=-1, keepdim=True) / val_max
    s_b = (s_dec_b / s_dec).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(s_b == 0, 1.0, s_b), s_dec


def forward_fp4(x: torch.Tensor, four_over_six: bool) -> torch.Tensor:
    """rtn_1x16s_fp4_kernel_wrapper(x, scale_override=1.0, group_size=16, four_over_six): the
    forward's NVFP4 copy of X or W, amax over the whole tensor."""
    xg = x.reshape(-1, GROUP).to(torch.float32)
    scales_max, val_max = (256.0 if four_over_six else 448.0), 6.0
    s_b, s_dec = get_scales(xg, x.abs().max(), val_max, scales_max)
    out = rtn_fp4(xg / (s_b * s_dec)) * (s_b * s_dec)
    if four_over_six:  # get_alt_scales: the block amax mapped to 4
        alt = (xg.abs().amax(dim=-1, keepdim=True) / val_max * (6 / 4) / s_dec).to(torch.float8_e4m3fn).float()
        alt = torch.where(alt == 0, 1.0, alt)
        out4 = rtn_fp4(xg / (alt * s_dec)) * (alt * s_dec)
        err6 = ((xg - out) * (xg - out)).sum(-1, keepdim=True)
        err4 = ((xg - out4) * (xg - out4)).sum(-1, keepdim=True)
        out = torch.where(err6 <= err4, out, out4)
    return out.reshape(x.shape).to(x.dtype)


def sr_e4m3(c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The kernel's stochastic rounding of the corrected scales: E4M3 codes beside c's nearest."""
    bits = c.to(torch.float8_e4m3fn).view(torch.uint8)
    prev = (bits - 1).view(torch.float8_e4m3fn).float()
    curr = bits.view(torch.float8_e4m3fn).float()
    nxt = (bits + 1).view(torch.float8_e4m3fn).float()
    up = torch.where(curr > c, curr, nxt)
    down = torch.where(curr > c, prev, curr)
    return torch.where(u < (c - down) / (up - down), up, down)


def rotate(x: torch.Tensor, had: torch.Tensor) -> torch.Tensor:
    """The kernel's rotation: x in rows of had's order times hadᵀ (wrapper: had.T.contiguous();
    kernel: `tl.dot(x, it)`)."""
    return x.contiguous().reshape(-1, had.shape[0]) @ had.T.contiguous()


def eden(x: torch.Tensor, had: torch.Tensor, amax: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """eden_1x16s_fp4_kernel_wrapper(x, had, (17/16)·0.93, 16, amax) with `u` the kernel's
    `tl.rand(seed, scale_offsets)`: one uniform per block scale, in flat order."""
    return eden_rotated(rotate(x, had), had.shape[0], amax, u).reshape(x.shape)


def eden_rotated(x_had: torch.Tensor, dim: int, amax: torch.Tensor, u: torch.Tensor,
                 scale_override: float = BACKWARD_SCALE_OVERRIDE) -> torch.Tensor:
    """The kernel after its rotation, on the rotated values x_had (groups of `dim` in order)."""
    xg = x_had.reshape(-1, GROUP)
    s_b, s_dec = get_scales(xg, amax, 6.0 / scale_override, 255.99)
    x_scaled = xg / (s_b * s_dec)
    x_fp4 = rtn_fp4(x_scaled)
    ys, qs = x_scaled.reshape(-1, dim), x_fp4.reshape(-1, dim)
    num, den = (ys * ys).sum(-1, keepdim=True), (ys * qs).sum(-1, keepdim=True)
    correction = torch.where(den == 0.0, 1.0, num / den)
    corrected = (s_b.reshape(-1, dim // GROUP) * correction).reshape(-1, 1)
    scales = sr_e4m3(corrected, u.reshape(-1, 1))
    return (x_fp4 * scales * s_dec).reshape(x_had.shape).to(x_had.dtype)


def rotated_amax(x: torch.Tensor, had: torch.Tensor) -> torch.Tensor:
    """Quartet_II_fn.backward's amax of an operand (not delayed): |x·hadᵀ| over the tensor."""
    return rotate(x, had).abs().max().float()


def backward(g: torch.Tensor, xq: torch.Tensor, wq: torch.Tensor, had: torch.Tensor,
             u: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quartet_II_fn.backward (delayed_amax False) from the forward's NVFP4 xq [N, in] and wq
    [out, in], with the re-drawn rotation `had` and the scale uniforms per operand
    (`grad_dgrad`, `weight_dgrad`, `grad_wgrad`, `input_wgrad`): (dX, dW)."""
    e_ht = eden(g, had, rotated_amax(g, had), u["grad_dgrad"])
    w_tht = eden(wq.T, had, rotated_amax(wq.T.contiguous(), had), u["weight_dgrad"])
    grad_input = F.linear(e_ht, w_tht, None)
    e_tht = eden(g.T, had, rotated_amax(g.T.contiguous(), had), u["grad_wgrad"])
    x_tht = eden(xq.T, had, rotated_amax(xq.T.contiguous(), had), u["input_wgrad"])
    grad_weight = F.linear(e_tht, x_tht, None)
    return grad_input, grad_weight
