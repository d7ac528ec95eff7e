"""`fake_quantize` and its relatives: blocking, dispatch to a family, the STE autograd wrapper.

The reference path below is plain torch on the input's device, run over chunks of blocks so its
temporaries stay a fraction of the tensor; `fastpath` replaces it on CPU with a compiled kernel
and `triton_kernels` on CUDA with Triton kernels, both bit-identical (tested), and is skipped silently whenever it does not apply. Stochastic
rounding draws from the counter-based stream of `philox.py` on both paths.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any

import torch

from qtransform.errors import UserError
from qtransform.formats import fastpath, philox, registry
from qtransform.formats.blocking import (
    BlockLayout,
    BlockQuant,
    from_blocks,
    make_layout,
    per_block,
    tensor_amax,
    to_blocks,
)
from qtransform.formats.options import WHOLE_ROW, QuantConfig, resolve
from qtransform.formats.registry import FormatSpec
from qtransform.formats.scaled import bind_dtype


def check_input(x: object, cfg: QuantConfig) -> None:
    """Only floating tensors can be fake-quantized."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{cfg.spec.name}: expected a floating-point tensor, got {got}")


CHUNK_ELEMENTS = 1 << 18  # reference path on CPU: elements per chunk (bounds its temporaries)
# on a GPU a chunk costs ~50 kernel launches, so small chunks made the 8192^2 reference path
# launch-bound (H200: 190 ms of launches for 18 ms of kernels); 2^22 keeps temporaries ~150 MB
GPU_CHUNK_ELEMENTS = 1 << 22
# every NaN we output, per dtype: fp32 0x7fc00000 and its bf16 / fp16 counterparts (torch's
# vectorized fp32 -> bf16 narrowing writes 0xffff, its scalar one 0x7fc0; a NaN element under
# a given tensor scale leaves torch's float8 cast as 0x7ff00000, or copysign with its sign and
# payload: pinned here)
_NAN_BITS = {torch.float32: (0x7FC00000, torch.int32), torch.bfloat16: (0x7FC0, torch.int16),
             torch.float16: (0x7E00, torch.int16)}


def canonical_nan_(t: torch.Tensor) -> torch.Tensor:
    """Set every NaN of an fp32/bf16/fp16 tensor to its dtype's canonical +qNaN, in place."""
    bits = _NAN_BITS.get(t.dtype)
    if bits is not None:
        t.masked_fill_(torch.isnan(t), torch.tensor(bits[0], dtype=bits[1]).view(t.dtype))
    return t


def layout_for(x: torch.Tensor, cfg: QuantConfig) -> BlockLayout:
    """The block layout of x under cfg (0-dim tensors are treated as shape (1,)); a block or
    tile longer than its axis is an error (`check_fits`), whole-row granularities block whole
    rows."""
    shape = tuple(x.shape) if x.ndim else (1,)
    check_fits(cfg, shape)
    block = cfg.block
    if cfg.granularity in WHOLE_ROW:
        block = max(shape[cfg.block_axis], 1)
    return _layout(shape, cfg.block_axis, block, cfg.tile)


def check_fits(cfg: QuantConfig, shape: tuple[int, ...]) -> None:
    """A block (tile side) longer than the axis it runs along is a UserError naming the axis
    length and the fix. The format's own default block is exempt: on a short axis (a tiny
    model) it covers the whole row, as it always has."""
    ndim = len(shape)
    if cfg.tile:
        sides = [(ndim - 2, cfg.tile[0]), (ndim - 1, cfg.tile[1])] if ndim >= 2 else []
        name = "block_shape " + "x".join(map(str, cfg.tile))
    elif cfg.granularity == "block" and cfg.block != cfg.spec.default_block:
        sides = [(cfg.block_axis, cfg.block)] if -ndim <= cfg.block_axis < ndim else []
        name = f"block_size {cfg.block}"
    else:
        return
    for dim, side in sides:
        n = shape[dim]
        if side > n and not (cfg.tile and side == cfg.spec.tile[dim - ndim + 2]):
            raise UserError(
                f"{cfg.name}: {name} is longer than axis {dim % ndim} of a tensor of shape "
                f"{list(shape)} ({n} elements); use a block of at most {n}, or granularity "
                "'channel' (weights) / 'token' (activations) for one scale per whole row")


_layout = functools.lru_cache(maxsize=1024)(make_layout)  # a weight sync asks for a few shapes


def stream_seed(
    cfg: QuantConfig, generator: torch.Generator | None, seed: int | None, device: torch.device
) -> int | None:
    """The Philox seed of a stochastic request: `seed` itself, else one draw from `generator`,
    else the config's own seed, else one draw from the global generator; None for deterministic
    rounding."""
    if cfg.rounding != "stochastic":
        return None
    if seed is not None:
        if generator is not None:
            raise UserError(f"{cfg.spec.name}: pass either seed= or generator=, not both")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise UserError(f"{cfg.spec.name}: seed must be an int, got {seed!r}")
        return seed
    if generator is None and cfg.seed is not None:
        return cfg.seed
    return philox.seed_from(generator, device)


def quantize_blocks(
    x: torch.Tensor, cfg: QuantConfig, seed: int | None = None, *,
    pos: torch.Tensor | None = None, amax_t: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
) -> tuple[BlockQuant, BlockLayout]:
    """Reference path: quantize x (any float dtype, any device) block by block in fp32.

    Stochastic rounding draws u from the stream of `seed` at the elements' linear positions
    `pos` (default: x's own) and tensor-level scales come from `amax_t` (default: x's amax;
    0-dim, or one value per row shaped like x with the blocked axis 1), or are the stored
    0-dim `scale_t` as it is: a chunk of a larger tensor passes them, so chunking changes no
    result.
    """
    layout = layout_for(x, cfg)
    cfg = bind_dtype(cfg, x.dtype)
    x32 = x.detach().to(torch.float32).reshape(layout.shape)
    blocks = to_blocks(x32, layout)
    u = None
    if cfg.rounding == "stochastic":
        if seed is None:
            raise ValueError("stochastic rounding needs the seed of its stream")
        if pos is None:
            pos = philox.positions(layout.shape, device=x.device)
        u = to_blocks(philox.uniform_at(seed, pos).reshape(layout.shape), layout)
    if scale_t is not None:
        amax_t = None
    elif amax_t is None and cfg.family.per_tensor(cfg):
        amax_t = tensor_amax(x32)
    elif amax_t is not None and amax_t.ndim:  # one amax per row: each block takes its row's
        amax_t = to_blocks(amax_t.expand(layout.shape), layout)[:, 0]
    if scale_t is None:  # a family's kernel takes a stored scale only if it has one (optional)
        return cfg.family.quantize(blocks, cfg, u, amax_t), layout
    return cfg.family.quantize(blocks, cfg, u, amax_t, scale_t), layout


def _chunking(layout: BlockLayout) -> tuple[int, int]:
    """(dim, unit): the reference path cuts along `dim` in multiples of `unit` elements, which
    never splits a block: any dim but the blocked one, or the blocked dim in whole blocks (tiles:
    rows in whole tiles). The dim with the most such units wins."""
    shape = layout.shape
    if layout.tile:
        return len(shape) - 2, layout.tile[0]
    options = [(d, 1) for d in range(len(shape)) if d != layout.axis]
    options.append((layout.axis, layout.block))
    return max(options, key=lambda o: -(-shape[o[0]] // o[1]))


def _reference(
    x: torch.Tensor, cfg: QuantConfig, seed: int | None, layout: BlockLayout, want_sat: bool,
    want_exps: bool, amax: torch.Tensor | None = None, scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The reference path over chunks of about CHUNK_ELEMENTS: results in x's dtype shaped
    `layout.shape` (its temporaries, about nine chunks of fp32, come on top). `amax` is a
    checked override of the tensor amax (`check_amax`), `scale` a stored tensor scale."""
    xs = x.detach().reshape(layout.shape)
    dim, unit = _chunking(layout)
    n = layout.shape[dim]
    per_unit = max(1, xs.numel() // max(n, 1) * unit)
    chunk = CHUNK_ELEMENTS if x.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    step = max(1, chunk // per_unit) * unit
    amax_t = None
    rows = None  # a per-row amax, expanded to the layout's shape (a view)
    if amax is not None and amax.ndim:
        rows = amax.expand(layout.shape)
    elif amax is not None:
        amax_t = amax
    elif cfg.family.per_tensor(cfg) and scale is None:
        parts = [tensor_amax(xs.narrow(dim, s, min(step, n - s)).to(torch.float32))
                 for s in range(0, n, step)]
        amax_t = torch.stack(parts).amax() if parts else None  # amax propagates NaN
    out = torch.empty(layout.shape, dtype=x.dtype, device=x.device)
    sat = torch.empty(layout.shape, dtype=torch.bool, device=x.device) if want_sat else None
    exps = (torch.empty(layout.grid_shape, dtype=torch.int32, device=x.device)
            if want_exps else None)
    for s in range(0, n, step):
        k = min(step, n - s)
        pos = (philox.positions(layout.shape, dim, s, k, x.device)
               if cfg.rounding == "stochastic" else None)
        part = amax_t if rows is None else rows.narrow(dim, s, k)
        res, lay = quantize_blocks(xs.narrow(dim, s, k), cfg, seed, pos=pos, amax_t=part,
                                   scale_t=scale)
        oc = out.narrow(dim, s, k)
        canonical_nan_(oc.copy_(from_blocks(res.out, lay)))
        if sat is not None:
            sat.narrow(dim, s, k).copy_(from_blocks(res.sat, lay))
        if exps is not None:
            exps.narrow(dim, s // unit, math.ceil(k / unit)).copy_(_exponents(res, lay, cfg))
    return out, sat, exps


def _forward(
    x: torch.Tensor, cfg: QuantConfig, generator: torch.Generator | None, want_sat: bool,
    want_exps: bool = False, seed: int | None = None, amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fake-quantized x in its own dtype, plus the saturation mask and the MX block exponents
    when asked for, all from one quantization. `amax`: a checked tensor-amax override; `scale`:
    a checked stored tensor scale (the torch path and the per-tensor FP8 kernel; the block
    kernels derive theirs)."""
    if cfg.granularity == "tensor" and not want_exps:  # FP8 with one scale: one compiled pass
        fast = fastpath.fp8_tensor(x, cfg, want_sat, amax, scale)
        if fast is not None:
            return fast
    layout = layout_for(x, cfg)
    seed = stream_seed(cfg, generator, seed, x.device)
    fast = _gpu_path(x, cfg, layout, want_sat, want_exps) if amax is None and scale is None else None
    if fast is None and scale is None:
        fast = fastpath.quantize(x, cfg, layout, want_sat, exponents=want_exps, seed=seed, amax=amax)
    if fast is None and _one_scale(x, cfg, want_exps):
        fast = _whole_tensor(x, cfg, want_sat, amax, scale)
    if fast is not None:
        out, sat, exps = fast
        assert out is not None
    else:
        out, sat, exps = _reference(x, cfg, seed, layout, want_sat, want_exps, amax, scale)
    if out.shape != x.shape:
        out = out.reshape(x.shape)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if exps is not None and not x.ndim:
        exps = exps.reshape(())
    return out, None if sat is None else sat.reshape(x.shape), exps


def _one_scale(x: torch.Tensor, cfg: QuantConfig, want_exps: bool) -> bool:
    """Whether x is quantized with one scale for all its elements, small enough for one pass
    (the KV cache at every attention call, a per-tensor activation): `_whole_tensor` then."""
    limit = CHUNK_ELEMENTS if x.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    return (cfg.granularity == "tensor" and not cfg.tile and cfg.rounding != "stochastic"
            and not want_exps and 0 < x.numel() <= limit)


def _whole_tensor(
    x: torch.Tensor, cfg: QuantConfig, want_sat: bool, amax: torch.Tensor | None,
    scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """The reference path's numbers for a tensor with one scale, as one block of all its
    elements: the family's kernel is elementwise given the scale, so the blocks' layout (and
    the padding of its rows) changes no value, and a small tensor skips it (a decode step
    quantizes each attention's whole cache at a few microseconds of per-call cost)."""
    bound = bind_dtype(cfg, x.dtype)
    blocks = x.detach().to(torch.float32).reshape(1, -1)
    if scale is not None:
        res = bound.family.quantize(blocks, bound, None, None, scale)
    else:
        res = bound.family.quantize(blocks, bound, None, tensor_amax(blocks) if amax is None else amax)
    out = canonical_nan_(res.out.reshape(x.shape).to(x.dtype))
    return out, res.sat.reshape(x.shape) if want_sat else None, None


def _gpu_path(
    x: torch.Tensor, cfg: QuantConfig, layout: BlockLayout, want_sat: bool, want_exps: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, None] | None:
    """The Triton kernels' result for a CUDA tensor they cover (`triton_kernels.py`), else None:
    triton is imported only here, only for CUDA tensors, and its absence is no error."""
    if x.device.type != "cuda" or not fastpath.enabled():
        return None
    try:
        from qtransform.formats import triton_kernels
    except ImportError:
        return None
    res = triton_kernels.quantize(x, cfg, layout, want_sat, want_exps)
    return None if res is None else (*res, None)


def _exponents(res: BlockQuant, layout: BlockLayout, cfg: QuantConfig) -> torch.Tensor:
    """Reference path: the family's shared exponents, shaped like the block grid."""
    assert cfg.family.exponents is not None
    return per_block(cfg.family.exponents(res), layout)


class _FakeQuant(torch.autograd.Function):
    """Straight-through estimator; optionally no gradient through saturated elements."""

    @staticmethod
    def forward(ctx, x, cfg, generator, seed, amax, scale):  # type: ignore[override]
        out, sat, _ = _forward(x, cfg, generator, want_sat=cfg.zero_saturated_grad, seed=seed,
                               amax=amax, scale=scale)
        if sat is not None:
            ctx.save_for_backward(sat)
        ctx.mask = sat is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.mask:
            (sat,) = ctx.saved_tensors
            grad = grad.masked_fill(sat, 0.0)
        return grad, None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    fmt: str | FormatSpec | QuantConfig,
    *,
    block_size: int | None = None,
    axis: int = -1,
    block_shape: tuple[int, int] | None = None,
    scale_rule: str = "floor",
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    seed: int | None = None,
    granularity: str | None = None,
    amax: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    **format_options: Any,
) -> torch.Tensor:
    """Quantize x to `fmt` and back (same dtype, shape and device); gradient straight through.

    Options are the numerics contract of docs/numerics.md: what one scale covers
    (`granularity`: blocks of `block_size` along `axis`, 2D tiles `block_shape` over the last
    two dims, whole rows per channel / per token, the whole tensor), the MX `scale_rule`, the
    element `rounding` (stochastic: the Philox stream of `seed`, or of one draw from
    `generator`), and format options `nvfp4_variant`, `int_range`, `fp8_variant`, `scale_dtype` and
    `zero_saturated_grad`. `amax` replaces x's own amax for the tensor-level scale (NVFP4's
    global scale, the scale of granularity "tensor"): a 0-dim tensor, or for NVFP4 one value
    per row (x's shape with the blocked axis 1). `scale` instead gives the tensor-level scale
    itself as a checkpoint stores it (0-dim: NVFP4's global scale g for compressed-tensors, its
    decode scale d for the other variants; the scale of granularity "tensor"), used as it is.
    Invalid values raise ValueError listing what is allowed. `fmt` may be a `QuantConfig`
    instead (then without options).
    """
    cfg = resolve(fmt, block_size=block_size, axis=axis, block_shape=block_shape,
                  granularity=granularity, scale_rule=scale_rule, rounding=rounding,
                  **format_options)
    check_input(x, cfg)
    amax = check_amax(x, cfg, amax)
    scale = check_scale(x, cfg, scale, amax)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuant.apply(x, cfg, generator, seed, amax, scale)
    return _forward(x, cfg, generator, want_sat=False, seed=seed, amax=amax, scale=scale)[0]


def check_amax(x: torch.Tensor, cfg: QuantConfig, amax: object) -> torch.Tensor | None:
    """The `amax=` override as fp32 on x's device, or a ValueError: the format must have a
    tensor-level scale; the value is a 0-dim tensor, or (NVFP4) one per row of x's blocks."""
    if amax is None:
        return None
    if not cfg.family.per_tensor(cfg):
        raise ValueError(
            f"{cfg.name}: amax= sets a tensor-level scale, which this config has none of; it "
            "applies to two-level NVFP4 and to granularity 'tensor' (fp8_*, int4, int8)")
    if not isinstance(amax, torch.Tensor) or not amax.is_floating_point():
        got = amax.dtype if isinstance(amax, torch.Tensor) else type(amax).__name__
        raise ValueError(f"{cfg.name}: amax must be a floating-point tensor, got {got}")
    if amax.ndim:
        rows = list(x.shape)
        if rows:
            rows[cfg.block_axis] = 1
        if cfg.granularity == "tensor" or cfg.tile or list(amax.shape) != rows:
            per_row = (f" or, for NVFP4 blocks, one per row shaped {rows} "
                       "(x.abs().amax(axis, keepdim=True))") if cfg.granularity != "tensor" else ""
            raise ValueError(f"{cfg.name}: amax must be a 0-dim tensor{per_row}; "
                             f"got shape {list(amax.shape)}")
    return amax.detach().to(device=x.device, dtype=torch.float32)


def check_scale(x: torch.Tensor, cfg: QuantConfig, scale: Any,
                amax: torch.Tensor | None) -> torch.Tensor | None:
    """The `scale=` stored tensor scale as 0-dim fp32 on x's device, or a ValueError: the format
    must have a tensor-level scale, and `amax=` must not be given too."""
    if scale is None:
        return None
    if amax is not None:
        raise ValueError(f"{cfg.name}: give amax= or scale=, not both")
    if not cfg.family.per_tensor(cfg):
        raise ValueError(
            f"{cfg.name}: scale= is a stored tensor-level scale, which this config has none of; "
            "it applies to two-level NVFP4 and to granularity 'tensor' (fp8_*, int4, int8)")
    if (type(scale) is torch.Tensor and scale.dtype == torch.float32 and not scale.ndim
            and scale.device == x.device and not scale.requires_grad):
        return scale  # already what the conversion below makes (a fixed scale, at every call)
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.numel() != 1:
        raise ValueError(f"{cfg.name}: scale must be a one-element floating-point tensor")
    return scale.detach().to(device=x.device, dtype=torch.float32).reshape(())


def saturated(x: torch.Tensor, fmt: str | FormatSpec | QuantConfig, **options: Any) -> torch.Tensor:
    """Bool mask of the elements clipped at the element max normal (same options as
    `fake_quantize`); NaN blocks count as not saturated. Feeds the saturation ratio metric."""
    options.pop("generator", None)
    options.pop("seed", None)
    amax = options.pop("amax", None)
    scale = options.pop("scale", None)
    cfg = resolve(fmt, **options)
    check_input(x, cfg)
    amax = check_amax(x, cfg, amax)
    scale = check_scale(x, cfg, scale, amax)
    sat = _forward(x, replace(cfg, rounding="rne"), None, want_sat=True, amax=amax,
                   scale=scale)[1]  # rounding-free
    assert sat is not None
    return sat


def block_exponents(x: torch.Tensor, fmt: str | FormatSpec | QuantConfig, **options: Any) -> torch.Tensor:
    """MX only: the unbiased shared exponent E of every block (int32, shaped like the block
    grid: the blocked dim replaced by its block count). Zero blocks read -127, NaN blocks 128."""
    options.pop("generator", None)
    options.pop("seed", None)
    cfg = _mx_only(_checked(x, fmt, options))
    cfg = replace(cfg, rounding="rne")  # E does not depend on it
    layout = layout_for(x, cfg)
    fast = fastpath.quantize(x, cfg, layout, False, exponents=True, values=False)
    if fast is not None:
        e = fast[2]
        assert e is not None
    else:
        e = _reference(x, cfg, None, layout, False, True)[2]
        assert e is not None
    return e.reshape(layout.grid_shape if x.ndim else ())


def four_over_six_blocks(x: torch.Tensor, fmt: str | FormatSpec | QuantConfig, *,
                         generator: torch.Generator | None = None, seed: int | None = None,
                         **options: Any) -> torch.Tensor:
    """NVFP4 with `four_over_six`: which blocks kept the max/4 block scale (bool, shaped like the
    block grid), the very choice `fake_quantize` makes with the same options, seed and `amax`
    (the reference path's own decision, chunk by chunk as it quantizes). What a scan reports as
    the share of max/4 blocks; the checkpoint holds the choice only implicitly, in the scales."""
    amax = options.pop("amax", None)
    cfg = _checked(x, fmt, options)
    if cfg.spec.name != "nvfp4" or cfg.four_over_six == "none":
        raise ValueError(f"{cfg.name}: four_over_six_blocks needs nvfp4 with four_over_six "
                         "'mse' or 'mae' (the blocks choose between max/6 and max/4 there only)")
    amax = check_amax(x, cfg, amax)
    seed = stream_seed(cfg, generator, seed, x.device)
    layout = layout_for(x, cfg)
    xs = x.detach().reshape(layout.shape)
    dim, unit = _chunking(layout)
    n = layout.shape[dim]
    if amax is None:
        amax = tensor_amax(xs.to(torch.float32))
    rows = amax.expand(layout.shape) if amax.ndim else None
    step = max(1, CHUNK_ELEMENTS // max(1, xs.numel() // max(n, 1) * unit)) * unit
    out = torch.empty(layout.grid_shape, dtype=torch.bool, device=x.device)
    for s in range(0, n, step):
        k = min(step, n - s)
        pos = (philox.positions(layout.shape, dim, s, k, x.device)
               if cfg.rounding == "stochastic" else None)
        res, lay = quantize_blocks(xs.narrow(dim, s, k), cfg, seed, pos=pos,
                                   amax_t=amax if rows is None else rows.narrow(dim, s, k))
        assert res.max4 is not None
        out.narrow(dim, s // unit, math.ceil(k / unit)).copy_(per_block(res.max4, lay))
    return out.reshape(layout.grid_shape if x.ndim else ())


def _checked(x: torch.Tensor, fmt: str | FormatSpec | QuantConfig, options: dict[str, Any]) -> QuantConfig:
    cfg = resolve(fmt, **options)
    check_input(x, cfg)
    return cfg


def _mx_only(cfg: QuantConfig) -> QuantConfig:
    if cfg.family.exponents is None:
        takers = [f.name.upper() for f in registry.families() if f.exponents is not None]
        raise ValueError(f"{cfg.spec.name}: block_exponents is defined for {'/'.join(takers)} "
                         "formats only (power-of-two block scales)")
    return cfg


def quantize_with_info(
    x: torch.Tensor,
    fmt: str | FormatSpec | QuantConfig,
    *,
    exponents: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(fake_quantize(x), saturated(x), block_exponents(x) if exponents)` with the same options,
    from one quantization instead of three: what a scan measures. No gradient. `exponents` is
    for MX formats only (ValueError otherwise)."""
    amax = options.pop("amax", None)
    cfg = _checked(x, fmt, options)
    amax = check_amax(x, cfg, amax)
    if exponents:
        _mx_only(cfg)
    with torch.no_grad():
        out, sat, exps = _forward(x, cfg, generator, want_sat=True, want_exps=exponents,
                                  seed=seed, amax=amax)
    assert sat is not None
    return out, sat, exps
