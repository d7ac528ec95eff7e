"""`fake_quantize` and its relatives: blocking, dispatch to a family, the STE autograd wrapper.

The reference path below is plain torch on the input's device; `fastpath` replaces it on CPU for
deterministic rounding with a compiled kernel that is bit-identical (tested), and is skipped
silently whenever it does not apply.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from qtransform.formats import fastpath
from qtransform.formats.blocking import (
    BlockLayout,
    BlockQuant,
    from_blocks,
    make_layout,
    per_block,
    to_blocks,
)
from qtransform.formats.intgroup import quantize_int
from qtransform.formats.mx import NAN_CODE, quantize_mx
from qtransform.formats.nvfp4 import quantize_nvfp4, tensor_amax
from qtransform.formats.options import QuantConfig, resolve
from qtransform.formats.registry import FormatSpec


def check_input(x: Any, cfg: QuantConfig) -> None:
    """Only floating tensors can be fake-quantized."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{cfg.spec.name}: expected a floating-point tensor, got {got}")


def layout_for(x: torch.Tensor, cfg: QuantConfig) -> BlockLayout:
    """The block layout of x under cfg (0-dim tensors are treated as shape (1,))."""
    shape = tuple(x.shape) if x.ndim else (1,)
    return make_layout(shape, cfg.axis, cfg.block, cfg.tile)


def quantize_blocks(
    x: torch.Tensor, cfg: QuantConfig, generator: torch.Generator | None = None
) -> tuple[BlockQuant, BlockLayout]:
    """Reference path: quantize x (any float dtype, any device) block by block in fp32."""
    layout = layout_for(x, cfg)
    x32 = x.detach().to(torch.float32).reshape(layout.shape)
    blocks = to_blocks(x32, layout)
    u = None
    if cfg.rounding == "stochastic":
        u = torch.rand(blocks.shape, generator=generator, device=blocks.device, dtype=torch.float32)
    if cfg.family == "mx":
        res = quantize_mx(blocks, cfg, u)
    elif cfg.family == "nvfp4":
        res = quantize_nvfp4(blocks, cfg, u, tensor_amax(x32))
    else:
        res = quantize_int(blocks, cfg, u)
    return res, layout


def _forward(
    x: torch.Tensor, cfg: QuantConfig, generator: torch.Generator | None, want_sat: bool,
    want_exps: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Fake-quantized x in its own dtype, plus the saturation mask and the MX block exponents
    when asked for, all from one quantization."""
    layout = layout_for(x, cfg)
    fast = fastpath.quantize(x, cfg, layout, want_sat, exponents=want_exps)
    if fast is not None:
        out, sat, exps = fast
        assert out is not None
    else:
        res, _ = quantize_blocks(x, cfg, generator)
        out = from_blocks(res.out, layout)
        sat = from_blocks(res.sat, layout) if want_sat else None
        exps = _exponents(res, layout) if want_exps else None
    out = out.reshape(x.shape).to(x.dtype)
    if exps is not None and not x.ndim:
        exps = exps.reshape(())
    return out, None if sat is None else sat.reshape(x.shape), exps


def _exponents(res: BlockQuant, layout: BlockLayout) -> torch.Tensor:
    """Reference path: E from the E8M0 codes, shaped like the block grid (NaN blocks: 128)."""
    e = torch.where(res.scales == NAN_CODE, 128, res.scales.to(torch.int32) - 127)
    return per_block(e, layout)


class _FakeQuant(torch.autograd.Function):
    """Straight-through estimator; optionally no gradient through saturated elements."""

    @staticmethod
    def forward(ctx, x, cfg, generator):  # type: ignore[override]
        out, sat, _ = _forward(x, cfg, generator, want_sat=cfg.zero_saturated_grad)
        if sat is not None:
            ctx.save_for_backward(sat)
        ctx.mask = sat is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.mask:
            (sat,) = ctx.saved_tensors
            grad = grad.masked_fill(sat, 0.0)
        return grad, None, None


def fake_quantize(
    x: torch.Tensor,
    fmt: str | FormatSpec,
    *,
    block_size: int | None = None,
    axis: int = -1,
    block_shape: tuple[int, int] | None = None,
    scale_rule: str = "floor",
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    **format_options: Any,
) -> torch.Tensor:
    """Quantize x to `fmt` and back (same dtype, shape and device); gradient straight through.

    Options are the numerics contract of docs/numerics.md: blocks along `axis` (or 2D tiles
    `block_shape` over the last two dims), the MX `scale_rule`, the element `rounding`
    (stochastic draws from `generator`), and format options `nvfp4_variant` and
    `zero_saturated_grad`. Invalid values raise ValueError listing what is allowed.
    """
    cfg = resolve(fmt, block_size=block_size, axis=axis, block_shape=block_shape,
                  scale_rule=scale_rule, rounding=rounding, **format_options)
    check_input(x, cfg)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuant.apply(x, cfg, generator)
    return _forward(x, cfg, generator, want_sat=False)[0]


def saturated(x: torch.Tensor, fmt: str | FormatSpec, **options: Any) -> torch.Tensor:
    """Bool mask of the elements clipped at the element max normal (same options as
    `fake_quantize`); NaN blocks count as not saturated. Feeds the saturation ratio metric."""
    options.pop("generator", None)
    cfg = resolve(fmt, **options)
    check_input(x, cfg)
    sat = _forward(x, replace(cfg, rounding="rne"), None, want_sat=True)[1]  # rounding-free
    assert sat is not None
    return sat


def block_exponents(x: torch.Tensor, fmt: str | FormatSpec, **options: Any) -> torch.Tensor:
    """MX only: the unbiased shared exponent E of every block (int32, shaped like the block
    grid: the blocked dim replaced by its block count). Zero blocks read -127, NaN blocks 128."""
    options.pop("generator", None)
    cfg = _mx_only(_checked(x, fmt, options))
    cfg = replace(cfg, rounding="rne")  # E does not depend on it
    layout = layout_for(x, cfg)
    fast = fastpath.quantize(x, cfg, layout, False, exponents=True, values=False)
    if fast is not None:
        e = fast[2]
        assert e is not None
    else:
        e = _exponents(quantize_blocks(x, cfg)[0], layout)
    return e.reshape(layout.grid_shape if x.ndim else ())


def _checked(x: torch.Tensor, fmt: str | FormatSpec, options: dict[str, Any]) -> QuantConfig:
    cfg = resolve(fmt, **options)
    check_input(x, cfg)
    return cfg


def _mx_only(cfg: QuantConfig) -> QuantConfig:
    if cfg.family != "mx":
        raise ValueError(f"{cfg.spec.name}: block_exponents is defined for MX formats only")
    return cfg


def quantize_with_info(
    x: torch.Tensor,
    fmt: str | FormatSpec,
    *,
    exponents: bool = False,
    generator: torch.Generator | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`(fake_quantize(x), saturated(x), block_exponents(x) if exponents)` with the same options,
    from one quantization instead of three: what a scan measures. No gradient. `exponents` is
    for MX formats only (ValueError otherwise)."""
    cfg = _checked(x, fmt, options)
    if exponents:
        _mx_only(cfg)
    with torch.no_grad():
        out, sat, exps = _forward(x, cfg, generator, want_sat=True, want_exps=exponents)
    assert sat is not None
    return out, sat, exps
