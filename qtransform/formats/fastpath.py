"""Compiled CPU fast path for fake quantization (bit-identical to the reference, stochastic
rounding included), for the error statistics of `qtransform.core.metrics.ErrorStats` (equal up to
summation order), and for vLLM CPU's attention and RoPE in the engine simulation (their ctypes
wrappers are `core/vllm_cpu_kernels.py`).

Eager torch spends one memory pass per elementwise op (a dozen per format, two dozen for the
metrics) and microseconds of dispatch per op; `qfast.c` does one pass per block and one pass for
all the metrics. It is compiled on first use with the system C compiler into a per-user cache
(`$QTRANSFORM_CACHE_DIR`, else `$XDG_CACHE_HOME/qtransform`, else `~/.cache/qtransform`), keyed by
the source, compiler, flags and CPU, written atomically with a manifest (size and SHA-256) that
is checked before every load, so a truncated or corrupted library is rebuilt instead of crashing
the process, and loaded with ctypes (which releases the GIL). No compiler, a failed build, a
non-CPU tensor or `QTRANSFORM_FASTPATH=0` all fall back silently to the torch reference path;
`unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from qtransform.formats import philox
from qtransform.formats.blocking import BlockLayout
from qtransform.formats.options import QuantConfig
from qtransform.formats.registry import SCALE_TORCH_DTYPES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qfast.c")
BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math",
              "-fno-math-errno"]  # sqrt stays the correctly rounded instruction, without errno
# tried in order: the first set that compiles is cached (no OpenMP runtime: single-threaded);
# OpenMP only where torch runs GNU OpenMP itself (`torch_openmp`)
FLAG_SETS = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])
OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")
MIN_PARALLEL = 1 << 16  # elements; below this one thread beats the OpenMP fork/join

_VARIANT = {"default": 0, "compressed-tensors": 1, "one_level": 2}
_RULE = {"floor": 0, "rceil": 1, "ceil": 2, "even": 3, "compressed-tensors": 4}
_ROUNDING = {"rne": 0, "rna": 1, "stochastic": 2}
_FOUR_OVER_SIX = {"none": 0, "mse": 1, "mae": 2}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # read natively by qfast.c


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in
                ("family", "variant", "scale_rule", "rna", "is_int", "mbits", "emin", "emax")]
    _fields_ += [(n, ctypes.c_float) for n in ("max_normal", "step", "inv_step", "qmax")]
    _fields_ += [("fos", ctypes.c_int32), ("gbound", ctypes.c_float)]


class _Fp8Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("variant", "rtz", "mbits", "emin", "pre", "sdt")]
    _fields_ += [("max_normal", ctypes.c_float)]


_FP8_VARIANTS = {"default": 0, "modelopt": 1, "vllm-cpu": 2}  # qf_fp8_tensor's variant codes
_FP8_ROUNDING = {"rne": 0, "rtz": 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False
_reason = ""


def enabled() -> bool:
    """False when the environment variable QTRANSFORM_FASTPATH is set to 0."""
    return os.environ.get("QTRANSFORM_FASTPATH", "1") != "0"


def cache_dir() -> Path:
    """Where compiled kernels are kept (per user, shared by processes)."""
    if os.environ.get("QTRANSFORM_CACHE_DIR"):
        return Path(os.environ["QTRANSFORM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qtransform"


def _cpu_id() -> str:
    """CPU model and feature flags, so a -march=native build is never reused on another CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> tuple[str, str] | None:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, version.stdout.splitlines()[0] if version.stdout else ""


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    paths = {ln.split()[-1] for ln in lines if ln.count(" ") >= 5 and "/" in ln}
    return {p for p in paths if Path(p).name.startswith(OPENMP_RUNTIMES)}


def torch_openmp() -> bool:
    """Whether the kernel may use OpenMP: only when torch's own runtime is GNU OpenMP
    (`libgomp.so.1`). The kernel's `libgomp.so.1` then binds to that already loaded library, so
    its threads are torch's intra-op pool (one pool, `torch.get_num_threads()` of them), never a
    second pool beside it that would oversubscribe the cores."""
    return any(Path(p).name.startswith("libgomp") for p in openmp_runtimes())


def _digest(data: bytes) -> str:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def manifest(lib: Path) -> Path:
    """The file holding the size and SHA-256 of a cached library, written before the library."""
    return lib.with_name(lib.name + ".sha256")


def verified(lib: Path) -> bool:
    """True when `lib` exists and matches its manifest (a truncated copy would SIGBUS on load)."""
    try:
        return manifest(lib).read_text().strip() == _digest(lib.read_bytes())
    except OSError:
        return False


def build() -> Path | None:
    """Compile qfast.c into the cache unless a verified build for this source/compiler/CPU is
    there; a cached library that fails verification is rebuilt."""
    global _reason
    found = _compiler()
    if found is None:
        log.debug("fast path: no C compiler found")
        _reason = f"no C compiler ({os.environ.get('CC', 'cc')} not found on PATH)"
        return None
    cc, version = found
    src = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([src, version.encode(), repr((BASE_FLAGS, FLAG_SETS, torch_openmp())).encode(),
                    _cpu_id().encode(), platform.machine().encode()])
    ).hexdigest()[:20]
    target = cache_dir() / key / "libqfast.so"
    if verified(target):
        return target
    if target.exists():
        log.warning("fast path: cached %s failed its size/checksum check; rebuilding", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for extra in FLAG_SETS:
        if "-fopenmp" in extra and not torch_openmp():
            continue
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *BASE_FLAGS, *extra, str(SOURCE), "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            res = None
            log.debug("fast path: %s failed: %s", " ".join(cmd), err)
        if res is not None and res.returncode == 0:
            # manifest first, then the library, each renamed atomically: a reader sees either
            # a matching pair or a mismatch (and rebuilds), never an unchecked library
            fd, tmp_manifest = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
            with os.fdopen(fd, "w") as f:
                f.write(_digest(Path(tmp).read_bytes()) + "\n")
            os.replace(tmp_manifest, manifest(target))
            os.replace(tmp, target)
            return target
        if res is not None:
            log.debug("fast path: %s failed:\n%s", " ".join(cmd), res.stderr)
            _reason = f"the C build failed ({' '.join(cmd)}): {res.stderr.strip()[-300:]}"
        Path(tmp).unlink(missing_ok=True)
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable."""
    global _lib, _failed, _reason
    if _lib is not None or _failed:
        return _lib
    with _lock:
        if _lib is None and not _failed:
            try:
                path = build()
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    lib.qf_quantize.restype = ctypes.c_int
                    lib.qf_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3 + [
                        ctypes.c_int64] * 5 + [ctypes.POINTER(_Params), ctypes.c_uint64,
                                               ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                               ctypes.c_void_p]
                    lib.qf_bincount.restype = None
                    lib.qf_bincount.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32,
                                                ctypes.c_int32, ctypes.c_void_p]
                    lib.qf_normal.restype = None
                    lib.qf_normal.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                              ctypes.c_uint64, ctypes.c_int, ctypes.c_float,
                                              ctypes.c_void_p, ctypes.c_int]
                    lib.qf_lse_dot.restype = None
                    lib.qf_lse_dot.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [
                        ctypes.c_void_p] * 2 + [ctypes.c_int]
                    lib.qf_stats.restype = ctypes.c_int
                    lib.qf_stats.argtypes = [ctypes.c_void_p] * 3 + [
                        ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                    lib.qf_fwht.restype = ctypes.c_int
                    lib.qf_fwht.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p] + [
                        ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
                    lib.qf_nvfp4_pack.restype = ctypes.c_int
                    lib.qf_nvfp4_pack.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 2 + [
                        ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                    lib.qf_fp8_tensor.restype = None
                    lib.qf_fp8_tensor.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                  ctypes.c_void_p, ctypes.c_int64,
                                                  ctypes.POINTER(_Fp8Params)] + [ctypes.c_void_p] * 2 + [
                        ctypes.c_int]
                    lib.qf_mxfp4_pack.restype = ctypes.c_int
                    lib.qf_mxfp4_pack.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 2 + [
                        ctypes.POINTER(_Params), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                    _lib = lib
            except OSError as err:
                log.debug("fast path: could not build or load the kernel: %s", err)
                _reason = f"could not build or load the kernel: {err}"
            _failed = _lib is None
    return _lib


def unavailable_reason() -> str | None:
    """Why the fast path is not used in this process, or None when it is available."""
    if not enabled():
        return "disabled by QTRANSFORM_FASTPATH=0"
    if library() is not None:
        return None
    return _reason or "the kernel could not be built"


@functools.lru_cache(maxsize=256)  # configs are frozen and hashable; a sync makes hundreds of calls
def _params(cfg: QuantConfig) -> _Params:
    e = cfg.spec.element
    return _Params(
        family=cfg.family.kernel_id or 0, variant=_VARIANT[cfg.nvfp4_variant],
        scale_rule=_RULE[cfg.scale_rule], rna=_ROUNDING[cfg.rounding],
        is_int=int(e.kind == "int"), mbits=e.mbits, emin=e.emin, emax=e.emax,
        max_normal=e.max_normal, step=e.step, inv_step=1.0 / e.step,
        qmax=float(e.qmax) if e.kind == "int" else e.max_normal,  # the plain-scale divisor
        fos=_FOUR_OVER_SIX[cfg.four_over_six], gbound=float(cfg.global_bound),
    )


@dataclasses.dataclass(frozen=True)
class _Call:
    """The arguments of a `qf_quantize` call that depend only on config, layout and dtype,
    worked out once: a rollout sync or a training step makes hundreds of calls on a few shapes,
    and working them out each time cost more than quantizing a small weight."""

    code: int
    shape: tuple[int, ...]  # the kernel's view of x: blocked axis last, contiguous
    moved: bool  # the blocked axis is not already last: move it there and back
    grid: tuple[int, ...]
    dims: tuple[int, int, int, int, int]  # batch, rows, cols, tile rows, tile cols
    post: int  # elements of a blocked row are `post` apart in x (see qfast.c sr_t)
    params: object  # ctypes.byref of the _Params
    parallel: bool


@functools.lru_cache(maxsize=1024)
def _call(cfg: QuantConfig, layout: BlockLayout, dtype: torch.dtype) -> _Call | None:
    code = _DTYPES.get(dtype, 0 if dtype == torch.float64 else None)  # float64: narrowed to fp32
    if code is None:
        return None
    shape = layout.shape
    if layout.tile:
        rows, cols = shape[-2:]
        tile_r, tile_c = layout.tile
        dims = (math.prod(shape[:-2]), rows, cols, tile_r, tile_c)
        moved, post = False, 1
        grid = (*shape[:-2], -(-rows // tile_r), -(-cols // tile_c))
    else:
        moved = layout.axis != len(shape) - 1
        if moved:
            shape = (*shape[: layout.axis], *shape[layout.axis + 1:], shape[layout.axis])
        cols = shape[-1]
        dims = (1, math.prod(shape) // cols, cols, 1, layout.block)
        post = math.prod(layout.shape[layout.axis + 1:])
        grid = (*shape[:-1], -(-cols // layout.block))
    return _Call(code, shape, moved, grid, dims, post, ctypes.byref(_params(cfg)),
                 math.prod(shape) >= MIN_PARALLEL)


def quantize(
    x: torch.Tensor, cfg: QuantConfig, layout: BlockLayout, want_sat: bool, *,
    exponents: bool = False, values: bool = True, seed: int | None = None,
    amax: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """(fake-quantized values shaped `layout.shape` in x's dtype (fp32 for float64) unless not
    `values`, saturation mask if `want_sat`, MX block exponents int32 shaped `layout.grid_shape`
    if `exponents`) from one pass, or None when the fast path does not apply (the caller then
    runs the reference path). Stochastic rounding draws from the Philox stream of `seed`;
    NVFP4's tensor scale comes from `amax` when given (0-dim fp32, or one per row of 1D
    blocks: x's shape with the blocked axis 1), else from x. `out`
    (blocks along x's last axis, a contiguous tensor of x's shape and dtype) receives the values
    instead of a new tensor; it may be x itself: the kernel reads each block before writing it."""
    if (
        (amax is not None and amax.ndim and layout.tile)
        or not x.is_cpu
        or cfg.family.kernel_id is None
        or cfg.granularity == "tensor"  # the kernels scale by each block's own amax
        or (cfg.int_range, cfg.scale_dtype, cfg.fp8_variant) != ("restricted", "float32", "default")
        or cfg.nvfp4_variant in ("modelopt", "vllm-kv", "flashinfer-kv", "quartet-ii", "vllm")  # the reference path only
        or cfg.four_over_six_order != "pairwise"  # the stacks' own orders: the reference path only
        or (seed is None and cfg.rounding == "stochastic")
        or cfg.rounding not in _ROUNDING  # truncation: the reference path only
        or x.numel() == 0
        or not enabled()
        or library() is None
    ):
        return None
    call = _call(cfg, layout, x.dtype)
    if call is None:
        return None
    amax_c = None if amax is None or amax.ndim else ctypes.c_float(float(amax))  # alive across the call
    rows = None  # one amax per row, in the order of the rows the kernel sees (axis moved last)
    if amax is not None and amax.ndim:
        rows = amax.reshape(layout.shape[:layout.axis] + (1,) + layout.shape[layout.axis + 1:])
        rows = rows.movedim(layout.axis, -1).to(torch.float32).contiguous()
    xs = x.detach()
    if xs.dtype == torch.float64:  # narrowed here, as the reference path does
        xs = xs.to(torch.float32)
    if xs.shape != layout.shape:
        xs = xs.reshape(layout.shape)
    xm = (xs.movedim(layout.axis, -1) if call.moved else xs).contiguous()
    if out is not None and (call.moved or not out.is_contiguous() or out.shape != xm.shape
                            or out.dtype != xm.dtype or not out.is_cpu):
        raise ValueError("quantize(out=...) needs blocks along the last axis and a contiguous "
                         "CPU tensor of x's shape and dtype")
    if values and out is None:
        out = torch.empty_like(xm)  # written natively
    sat = torch.empty(call.shape, dtype=torch.bool) if want_sat and values else None
    exps = torch.empty(call.grid, dtype=torch.int32) if exponents else None
    assert _lib is not None
    if _lib.qf_quantize(
        xm.data_ptr(), call.code, _ptr(out), _ptr(sat), _ptr(exps), *call.dims, call.params,
        (seed or 0) % (1 << 64), call.post, torch.get_num_threads() if call.parallel else 1,
        None if amax_c is None else ctypes.addressof(amax_c), _ptr(rows) or None,
    ):
        raise MemoryError("qf_quantize: out of memory")
    if call.moved:
        out, sat, exps = (None if t is None else t.movedim(-1, layout.axis) for t in (out, sat, exps))
    return out, sat, exps


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


@functools.lru_cache(maxsize=256)
def _fp8_call(cfg: QuantConfig, dtype: torch.dtype) -> tuple[int, object] | None:
    """(dtype code, ctypes.byref of the `qf_fp8_tensor` parameters) for an FP8 config with one
    scale per tensor on `dtype`, or None where the kernel does not cover it: another family or
    granularity, or stochastic rounding."""
    code = _DTYPES.get(dtype)
    e = cfg.spec.element
    if (
        code is None
        or cfg.family.name != "fp8"
        or cfg.granularity != "tensor"
        or cfg.tile
        or cfg.rounding not in _FP8_ROUNDING
        or cfg.fp8_variant not in _FP8_VARIANTS
    ):
        return None
    # the scale dtype of compressed-tensors' order (`scaled.bind_dtype`: "input" is x's dtype)
    sdt = _DTYPES[dtype] if cfg.scale_dtype == "input" else _DTYPES[SCALE_TORCH_DTYPES[cfg.scale_dtype]]
    params = _Fp8Params(variant=_FP8_VARIANTS[cfg.fp8_variant], rtz=_FP8_ROUNDING[cfg.rounding],
                        mbits=e.mbits, emin=e.emin, pre=int(cfg.fp8_variant == "vllm-cpu" and e.name == "e4m3"),
                        sdt=sdt, max_normal=e.max_normal)
    return code, ctypes.byref(params)


def fp8_tensor(
    x: torch.Tensor, cfg: QuantConfig, want_sat: bool, amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, None] | None:
    """FP8 with one scale for the whole tensor (granularity "tensor": a KV cache at every
    attention call, a per-tensor activation) in one compiled pass: (values in x's shape and
    dtype, saturation mask if `want_sat`, None), bit for bit `formats/fp8.py`'s numbers for
    every `fp8_variant`, rounding "rne" or "rtz". The scale is the stored `scale` (0-dim fp32),
    else from `amax` (0-dim fp32), else from x's own amax. None where that does not apply
    (the caller then runs the torch path). Eager torch spends about twenty dispatched ops on
    it, which on a decode step's few thousand elements cost far more than the arithmetic."""
    call = _fp8_call(cfg, x.dtype)
    given = scale if scale is not None else amax
    if (call is None or not x.is_cpu or x.numel() == 0 or not enabled() or library() is None
            or (given is not None and (given.dtype != torch.float32 or not given.is_cpu))):
        return None
    code, params = call
    xs = x.detach()
    if not xs.is_contiguous():
        xs = xs.contiguous()
    out = torch.empty_like(xs)  # a third of torch.empty's per-call cost
    sat = torch.empty_like(xs, dtype=torch.bool) if want_sat else None
    n = xs.numel()
    assert _lib is not None
    _lib.qf_fp8_tensor(xs.data_ptr(), code, out.data_ptr(), _ptr(sat), n, params,
                       None if amax is None or scale is not None else amax.data_ptr(),
                       None if scale is None else scale.data_ptr(),
                       torch.get_num_threads() if n >= MIN_PARALLEL else 1)
    return out, sat, None


STATS_SLOTS = 21  # qtransform.core.metrics._FIELDS: 15 sums and counts, 5 counts, max |e|


def error_stats(
    x: torch.Tensor, xq: torch.Tensor, saturated: torch.Tensor | None, acc: torch.Tensor
) -> bool:
    """Add the `ErrorStats` sums of the pairs (x, xq) into `acc` (CPU float64, `STATS_SLOTS`)
    in one compiled pass; False (acc untouched) where that does not apply: another device or
    dtype, mixed dtypes, a non-bool mask, no compiler, `QTRANSFORM_FASTPATH=0`."""
    code = _DTYPES.get(x.dtype)
    if (
        code is None
        or xq.dtype != x.dtype
        or not (x.is_cpu and xq.is_cpu and acc.is_cpu)
        or (saturated is not None and (saturated.dtype != torch.bool or not saturated.is_cpu))
        or not enabled()
        or library() is None
    ):
        return False
    x, xq = x.contiguous(), xq.contiguous()
    sat = None if saturated is None else saturated.contiguous()
    n = x.numel()
    threads = torch.get_num_threads() if n >= MIN_PARALLEL else 1
    assert _lib is not None
    if _lib.qf_stats(x.data_ptr(), xq.data_ptr(), _ptr(sat), n, code, acc.data_ptr(), threads):
        raise MemoryError("qf_stats: out of memory")
    return True


def bincount(values: torch.Tensor, low: int, counts: torch.Tensor) -> bool:
    """Add a histogram of int32 `values` into `counts` (CPU int64, bins low.. plus one bin below
    and one above at the ends) in one serial pass; False (counts untouched) where that does not
    apply. Serial on purpose: block exponents are small, a parallel region is not."""
    if (
        values.dtype != torch.int32
        or values.device.type != "cpu"
        or counts.dtype != torch.int64
        or not counts.is_contiguous()
        or not enabled()
        or library() is None
    ):
        return False
    v = values.contiguous()
    assert _lib is not None
    _lib.qf_bincount(v.data_ptr(), v.numel(), low, counts.numel() - 2, counts.data_ptr())
    return True


NORMAL_OPS = {"draw": 0, "add": 1, "relative": 2}  # qf_normal's op codes
_NORMAL_K = torch.tensor(philox.NORMAL_CONSTANTS, dtype=torch.float32)  # qf_normal reads it


def normal(seed: int, shape: tuple[int, ...], x: torch.Tensor | None = None, op: str = "draw",
           scale: float = 0.0, inplace: bool = False) -> torch.Tensor | None:
    """The Gaussian stream of `seed` (formats/philox.py), shaped `shape`, in one compiled pass:
    the draws z (op "draw"), or x + scale*z ("add") or x*(1 + scale*z) ("relative") for an fp32
    CPU tensor x of that shape, bit for bit the torch version's values; None where that does not
    apply (another device or dtype, no compiler, `QTRANSFORM_FASTPATH=0`). `inplace` writes the
    result into x itself (contiguous): each element is read before it is written, at its own
    position, so the bits are the same and no output memory is touched for the first time."""
    if inplace and (x is None or not x.is_contiguous()):
        raise ValueError("normal(inplace=True) writes into x, which must be a contiguous tensor")
    if (x is not None and (x.dtype != torch.float32 or not x.is_cpu)) or not enabled() or library() is None:
        return None
    n = math.prod(shape)
    xs = None if x is None else x.detach().contiguous()
    out = xs if inplace else torch.empty(shape, dtype=torch.float32)
    assert _lib is not None
    _lib.qf_normal(_ptr(xs), out.data_ptr(), n, seed % (1 << 64), NORMAL_OPS[op], scale,
                   _NORMAL_K.data_ptr(), torch.get_num_threads() if n >= MIN_PARALLEL else 1)
    return out


def lse_dot(x: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of fp32 CPU logits x [rows, cols] and float64 ref of that shape: (float64
    log-sum-exp of x, float64 dot product with ref) in one compiled pass without a float64 copy
    of x (the sums' order differs from torch's by a few ulps); None where that does not apply."""
    if (x.dtype != torch.float32 or ref.dtype != torch.float64 or not (x.is_cpu and ref.is_cpu)
            or x.dim() != 2 or ref.shape != x.shape or x.shape[1] == 0 or not enabled()
            or library() is None):
        return None
    x, ref = x.detach().contiguous(), ref.contiguous()
    rows, cols = x.shape
    lse = torch.empty(rows, dtype=torch.float64)
    dot = torch.empty(rows, dtype=torch.float64)
    assert _lib is not None
    _lib.qf_lse_dot(x.data_ptr(), ref.data_ptr(), rows, cols, lse.data_ptr(), dot.data_ptr(),
                    torch.get_num_threads() if x.numel() >= MIN_PARALLEL else 1)
    return lse, dot


def fwht(x: torch.Tensor, block_size: int, signs: torch.Tensor | None, scale: float, *,
         out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The blockwise Walsh-Hadamard transform of `formats.hadamard.fwht` along the last axis of
    an fp32/bf16/fp16 CPU tensor, in one compiled pass per row (the same fp32 butterflies as the
    torch version, so the same bits), written into `out` (x's shape and dtype, contiguous; x
    itself for in place) or a new tensor; None where that does not apply."""
    code = _DTYPES.get(x.dtype)
    if code is None or not x.is_cpu or x.numel() == 0 or not enabled() or library() is None:
        return None
    n = x.shape[-1]
    xs = x.detach().contiguous()
    if out is None:
        out = torch.empty_like(xs)
    if not (out.is_contiguous() and out.dtype == x.dtype and out.shape == x.shape and out.is_cpu):
        raise ValueError("fwht(out=...) must be a contiguous CPU tensor of x's shape and dtype")
    sg = None if signs is None else signs.to(torch.float32).contiguous()
    assert _lib is not None
    if _lib.qf_fwht(xs.data_ptr(), code, out.data_ptr(), xs.numel() // n, n, block_size, _ptr(sg) or None,
                    scale, torch.get_num_threads() if xs.numel() >= MIN_PARALLEL else 1):
        raise MemoryError("qf_fwht: out of memory")
    return out


def nvfp4_pack(x: torch.Tensor, g: float, scale_dtype: torch.dtype, *,
               modelopt: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a checkpoint stores for the compressed-tensors NVFP4 order on a 2-D CPU weight whose
    rows are whole 16-element blocks (rounding to nearest even), `g` its tensor scale and
    `scale_dtype` the dtype of the block-amax division: (uint8 packed E2M1 codes [rows, cols/2],
    float8_e4m3fn block scales [rows, cols/16]) in one pass, or None (no kernel, another dtype,
    or a NaN / infinite element: the caller's reference path decides). `modelopt`: ModelOpt's
    export order instead (`g` its decode scale d, `scale_dtype` float32), the sign bit x's."""
    if (x.dim() != 2 or x.shape[1] % 16 or not x.is_cpu or x.dtype not in _DTYPES
            or scale_dtype not in _DTYPES or x.numel() == 0 or not enabled() or library() is None):
        return None
    xs = x.detach().contiguous()
    rows, cols = xs.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // 16, dtype=torch.uint8)
    threads = torch.get_num_threads() if xs.numel() >= MIN_PARALLEL else 1
    assert _lib is not None
    if _lib.qf_nvfp4_pack(xs.data_ptr(), _DTYPES[xs.dtype], rows, cols, g, _DTYPES[scale_dtype],
                          int(modelopt), packed.data_ptr(), scales.data_ptr(), threads):
        return None
    return packed, scales.view(torch.float8_e4m3fn)


def mxfp4_pack(x: torch.Tensor, cfg: QuantConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What a checkpoint stores for MXFP4 (`cfg`: blocks of 32 along rows, rounding to nearest
    even) on a 2-D CPU weight: (uint8 packed E2M1 codes [rows, cols/2], uint8 E8M0 exponents + 127
    [rows, cols/32]) in one pass, or None (no kernel, another layout, or a NaN / infinite
    element: the caller's reference path decides)."""
    if (x.dim() != 2 or x.shape[1] % 32 or not x.is_cpu or x.dtype not in _DTYPES
            or x.numel() == 0 or not enabled() or library() is None):
        return None
    xs = x.detach().contiguous()
    rows, cols = xs.shape
    packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, cols // 32, dtype=torch.uint8)
    threads = torch.get_num_threads() if xs.numel() >= MIN_PARALLEL else 1
    assert _lib is not None
    if _lib.qf_mxfp4_pack(xs.data_ptr(), _DTYPES[xs.dtype], rows, cols, ctypes.byref(_params(cfg)),
                          packed.data_ptr(), scales.data_ptr(), threads):
        return None
    return packed, scales
