"""The compiled vLLM CPU attention and RoPE (`formats/qfast.c`), called from torch tensors.

They live in the fast path's library (`formats/fastpath.py` builds and loads it); their torch
references, which say what they compute, are `core/attention_kernels.vllm_cpu_reference` and
`core/engine_rotary.py`. Each wrapper returns None where the library is unavailable (no
compiler, `QTRANSFORM_FASTPATH=0`, a tensor off the CPU): the caller then runs the reference.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from qtransform.formats import fastpath

ELEMENTS = {"e4m3": 1, "e5m2": 2}  # the kernel's FP8 cache elements (0: a 16/32-bit cache)


def _library() -> ctypes.CDLL | None:
    """The fast path's library with these two kernels' signatures declared."""
    if not fastpath.enabled():
        return None
    lib = fastpath.library()
    if lib is not None and lib.qf_vllm_attention.argtypes is None:
        lib.qf_vllm_rotary.restype = None
        lib.qf_vllm_rotary.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        lib.qf_vllm_attention.restype = ctypes.c_int
        lib.qf_vllm_attention.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p] + [
            ctypes.c_int64] * 6 + [ctypes.c_float] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, scale: float,
              logit_scale: float = 0.0, v_scale: float = 1.0,
              codes: tuple[float, float, str] | None = None, causal: bool = False) -> Tensor | None:
    """vLLM CPU's attention rows (`qf_vllm_attention`): q [B, H, Tq, D], k and v [B, Hkv, Tk, D]
    in fp32; which keys each query reads: keep [B, Tq, Tk] bool, or None for every key (with
    `causal`: those up to the query's own position, the last Tq of Tk); an FP8 cache's
    `logit_scale` and `v_scale`, its codes in k and v, or recovered from them by the kernel with
    `codes` (k_scale, v_scale, element); the output [B, Tq, H, D] in fp32, or None."""
    if not q.is_cpu:
        return None
    lib = _library()
    if lib is None:
        return None
    q, k, v = (t.to(torch.float32).contiguous() for t in (q, k, v))
    keep_ptr = None if keep is None else keep.to(torch.uint8).contiguous()
    b, h, tq, d = q.shape
    out = torch.empty(b, tq, h, d, dtype=torch.float32)
    threads = torch.get_num_threads() if b * h * tq * k.shape[2] * d >= fastpath.MIN_PARALLEL else 1
    divisors = (ctypes.c_float * 2)(*(codes[:2] if codes else (1.0, 1.0)))
    element = ELEMENTS[codes[2]] if codes else 0
    status = lib.qf_vllm_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                   None if keep_ptr is None else keep_ptr.data_ptr(), int(causal),
                                   out.data_ptr(), b, h, k.shape[1], tq, k.shape[2], d,
                                   ctypes.c_float(scale), ctypes.c_float(logit_scale),
                                   ctypes.c_float(v_scale), divisors, element, threads)
    if status != 0:
        raise MemoryError("vLLM CPU attention kernel: out of memory for its row buffers")
    return out


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """vLLM CPU's NeoX rotary (`qf_vllm_rotary`): x [B, H, T, D], cos and sin [B, T, D]; fp32
    out, or None."""
    if not (x.is_cpu and cos.is_cpu):
        return None
    lib = _library()
    if lib is None:
        return None
    b, h, t, d = x.shape
    x = x.to(torch.float32).contiguous()
    cos, sin = (c.to(torch.float32).expand(b, t, d).contiguous() for c in (cos, sin))
    out = torch.empty_like(x)
    lib.qf_vllm_rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), b, h, t, d)
    return out
