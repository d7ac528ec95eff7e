"""ONNX function bodies of qtransform's custom ops, built from the format registry.

An exported graph holds one opaque `qtransform.<FORMAT>FakeQuant` node per quantized tensor; this
module writes the model-local FunctionProto that defines it with standard ONNX ops, so plain
onnxruntime runs the file and gives the torch reference's numbers bit for bit. Each body mirrors
`qtransform.formats` operation for operation in fp32 (docs/onnx.md lists the few places where a
different op gives the same bits):

- exact exponents: `floor_log2` (per block) is estimated with Log and corrected against an exact
  table of powers of two (Gather), so it is exact for every fp32 including subnormals;
- element rounding finds the grid step by comparisons with powers of two, or for FP8 elements is
  a saturating Cast to the float8 type (round half to even, opset >= 19);
- ReduceMax ignores NaN in onnxruntime, so block maxima are taken over NaN-free copies and NaN is
  put back explicitly where the reference propagates it;
- signs are copied by multiplying with +-1 from the sign of `1 / y` (which also sees -0.0):
  onnxruntime's Where loses -0.0 taken from its true branch;
- a Div(1, a) feeding a Mul gets a no-op Min in between, or onnxruntime would fuse the two into
  one division with different rounding.

One FunctionProto is built per distinct (op_type, attributes, static input shape); nodes select
theirs with the ONNX IR 10 `overload` field, whose name is derived from those.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import FunctionProto, NodeProto, TensorProto, helper, numpy_helper

from qtransform.errors import UserError
from qtransform.formats.options import resolve
from qtransform.formats.registry import E4M3, ElementSpec, FormatSpec

DOMAIN = "qtransform"
FLT_MAX = float(np.finfo(np.float32).max)
POW2_MIN, POW2_MAX = -149, 128  # table range of exact powers of two (2^128 reads +inf)


class ExportError(UserError):
    """The model could not be exported; the message names the op or site that failed."""


class UnsupportedExport(ValueError):
    """A fake-quant configuration that has no ONNX body (names the format and option)."""


@dataclass(frozen=True)
class FakeQuantConfig:
    """One fake-quant node's numerics, resolved with the format's defaults."""

    spec: FormatSpec
    axis: int
    block: int  # 1D block length (0 with tiles)
    tile: tuple[int, int] | None
    scale_rule: str
    rounding: str
    variant: str
    # Static input dims (None where symbolic), when known: bodies then block with constant
    # shapes, which keeps every intermediate shape known to onnxruntime (see `static_blocks`).
    shape: tuple[int | None, ...] | None = None

    @classmethod
    def from_options(cls, fmt: str, options: dict[str, Any]) -> FakeQuantConfig:
        """Validate like `fake_quantize` does, so export rejects exactly what PyTorch rejects."""
        opts = {k: v for k, v in options.items() if k not in ("zero_saturated_grad", "generator")}
        if isinstance(opts.get("block_shape"), list):
            opts["block_shape"] = tuple(opts["block_shape"])
        cfg = resolve(fmt, **opts)
        return cls(cfg.spec, cfg.axis, cfg.block, cfg.tile, cfg.scale_rule, cfg.rounding,
                   cfg.nvfp4_variant)

    def kwargs(self) -> dict[str, Any]:
        """Keyword options of `qtransform.formats.fake_quantize` / `encode` for this config."""
        kw: dict[str, Any] = {"axis": self.axis, "rounding": self.rounding}
        kw |= {"block_shape": self.tile} if self.tile else {"block_size": self.block}
        if self.spec.family == "mx":
            kw["scale_rule"] = self.scale_rule
        if self.spec.family == "nvfp4":
            kw["nvfp4_variant"] = self.variant
        return kw

    def attributes(self) -> dict[str, Any]:
        """The node attributes: every option that changes the numbers."""
        attrs: dict[str, Any] = {"axis": self.axis, "rounding": self.rounding}
        if self.tile:
            attrs["block_shape"] = list(self.tile)
        else:
            attrs["block_size"] = self.block
        if self.spec.family == "mx":
            attrs["scale_rule"] = self.scale_rule
        if self.spec.family == "nvfp4":
            attrs["nvfp4_variant"] = self.variant
        return attrs

    def overload(self) -> str:
        """A stable identifier of the attributes and, for static bodies, the input shape
        (the function's IR 10 overload name)."""
        block = "x".join(map(str, self.tile)) if self.tile else str(self.block)
        parts = [f"b{block}", f"axis{self.axis}".replace("-", "m"), self.rounding]
        if self.spec.family == "mx":
            parts.append(self.scale_rule)
        if self.spec.family == "nvfp4":
            parts.append(self.variant.replace("-", "_"))
        if self.static_blocks():
            parts.append("s" + "x".join("d" if d is None else str(d) for d in self.shape or ()))
        return "_".join(parts)

    def static_blocks(self) -> bool:
        """True when the blocked dims (and every dim after a 1D blocking axis) are static."""
        if not self.shape:
            return False
        rank = len(self.shape)
        if self.tile:
            return rank >= 2 and None not in self.shape[-2:]
        return -rank <= self.axis < rank and None not in self.shape[self.axis % rank:]


@dataclass
class Body:
    """Nodes of one function body; every op returns the name of its (first) output."""

    nodes: list[NodeProto] = field(default_factory=list)
    _count: int = 0

    def _name(self, op_type: str) -> str:
        self._count += 1
        return f"{op_type.lower()}_{self._count}"

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        out = self._name(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        """A Constant node (scalars stay 0-dim so they broadcast)."""
        arr = np.asarray(value, dtype=dtype)
        out = self._name("const")
        self.nodes.append(helper.make_node("Constant", [], [out], value=numpy_helper.from_array(arr, out)))
        return out

    def ints(self, *values: int) -> str:
        return self.const(list(values), np.int64)

    def embed(self, prefix: str, rename: dict[str, str]) -> list[NodeProto]:
        """The nodes with values and node names moved under `prefix/` (except `rename`d ones),
        ready to live in a graph beside other bodies."""
        out = []
        for inner in self.nodes:
            new = copy.deepcopy(inner)
            new.input[:] = [rename.get(v, f"{prefix}/{v}") for v in inner.input]
            new.output[:] = [rename.get(v, f"{prefix}/{v}") for v in inner.output]
            new.name = f"{prefix}/{inner.output[0]}"
            out.append(new)
        return out


# -- exact exponent arithmetic --------------------------------------------------------------
def _pow2_table() -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.ldexp(np.float32(1.0), np.arange(POW2_MIN, POW2_MAX + 1)).astype(np.float32)


def pow2(b: Body, k: str) -> str:
    """Exact 2^k (fp32) for integer-valued fp32 k in [-149, 128] (2^128 reads +inf)."""
    idx = b.op("Cast", b.op("Sub", k, b.const(POW2_MIN)), to=TensorProto.INT64)
    return b.op("Gather", b.const(_pow2_table()), idx)


def floor_log2(b: Body, a: str) -> str:
    """Exact floor(log2(a)) as fp32 for a >= 0 (a = 0 reads -150, +inf 128, NaN 0).

    Log gives an estimate within one of the answer; comparing with the exact neighbouring powers
    of two fixes it, so it is exact for subnormals and just below powers of two (7.9999995 -> 2).
    """
    est = b.op("Floor", b.op("Mul", b.op("Log", a), b.const(1 / math.log(2))))
    est = b.op("Min", b.op("Max", est, b.const(POW2_MIN)), b.const(POW2_MAX - 1))
    est = b.op("Where", b.op("IsNaN", est), b.const(0.0), est)
    low = pow2(b, est)
    high = pow2(b, b.op("Add", est, b.const(1.0)))
    down = b.op("Cast", b.op("Less", a, low), to=TensorProto.FLOAT)
    up = b.op("Cast", b.op("GreaterOrEqual", a, high), to=TensorProto.FLOAT)
    return b.op("Add", b.op("Sub", est, down), up)


def ceil_log2(b: Body, a: str) -> str:
    """Exact ceil(log2(a)) for finite a > 0: floor_log2 + 1 unless a is a power of two."""
    fl = floor_log2(b, a)
    exact = b.op("Cast", b.op("Equal", pow2(b, fl), a), to=TensorProto.FLOAT)
    return b.op("Sub", b.op("Add", fl, b.const(1.0)), exact)


# -- element rounding ------------------------------------------------------------------------
def round_to_integer(b: Body, t: str, rounding: str) -> str:
    """Round non-negative t: half-to-even (ONNX Round) or half away (floor(t + 0.5))."""
    if rounding == "rne":
        return b.op("Round", t)
    if rounding == "rna":
        return b.op("Floor", b.op("Add", t, b.const(0.5)))
    raise UnsupportedExport(f"rounding {rounding!r} has no ONNX body (stochastic draws cannot be reproduced)")


FLOAT8_CASTS = {"e4m3": TensorProto.FLOAT8E4M3FN, "e5m2": TensorProto.FLOAT8E5M2}


def round_magnitude(b: Body, a: str, elem: ElementSpec, rounding: str) -> str:
    """|y| rounded onto the element grid and saturated (elements.round_magnitude).

    FP8 elements with ties to even are a saturating Cast to the ONNX float8 type and back
    (opset >= 19). Other float elements find their grid step 2^(max(floor_log2 a, emin) - mbits)
    by comparing a with the powers of two 2^(emin+1) .. 2^emax: exact, and a few cheap ops per
    element where Log and Gather cost ten times more (values at or above 2^(emax+1) round to at
    least that and saturate either way).
    """
    if elem.kind == "float" and rounding == "rne" and elem.name in FLOAT8_CASTS:
        return b.op("Cast", b.op("Cast", a, to=FLOAT8_CASTS[elem.name], saturate=1), to=TensorProto.FLOAT)
    if elem.kind == "float":
        step, inv = b.const(2.0 ** (elem.emin - elem.mbits)), b.const(2.0 ** (elem.mbits - elem.emin))
        for k in range(elem.emin + 1, elem.emax + 1):
            above = b.op("GreaterOrEqual", a, b.const(2.0**k))
            step = b.op("Where", above, b.const(2.0 ** (k - elem.mbits)), step)
            inv = b.op("Where", above, b.const(2.0 ** (elem.mbits - k)), inv)
        r = b.op("Mul", round_to_integer(b, b.op("Mul", a, inv), rounding), step)
    else:
        t = a if elem.step == 1.0 else b.op("Mul", a, b.const(1.0 / elem.step))
        r = round_to_integer(b, t, rounding)
        r = r if elem.step == 1.0 else b.op("Mul", r, b.const(elem.step))
    return b.op("Min", r, b.const(elem.max_normal))


def sign_of(b: Body, y: str) -> str:
    """-1.0 where y is negative or -0.0 (1/y < 0), else 1.0 (NaN included).

    Multiplying by it is how signs are copied: onnxruntime's Where turns a -0.0 taken from
    its true branch into +0.0, so signed zeros never travel through a Where's true branch.
    """
    neg = b.op("Less", b.op("Div", b.const(1.0), y), b.const(0.0))
    return b.op("Where", neg, b.const(-1.0), b.const(1.0))


def round_signed(b: Body, y: str, elem: ElementSpec, rounding: str) -> str:
    """copysign(round_magnitude(|y|), y): -0.0 stays -0.0."""
    sign = sign_of(b, y)
    return b.op("Mul", round_magnitude(b, b.op("Mul", y, sign), elem, rounding), sign)


# -- block maxima ----------------------------------------------------------------------------
def amax_or_inf(b: Body, x: str, axes: str) -> str:
    """Block max |x| (keepdims), +inf where the block holds NaN or Inf: enough to flag it."""
    a = b.op("Abs", x)
    clean = b.op("Where", b.op("IsNaN", a), b.const(np.inf), a)
    return b.op("ReduceMax", clean, axes, keepdims=1)


def amax_nan(b: Body, x: str, axes: str | None) -> str:
    """Max |x| with torch's semantics: NaN if any element is NaN (axes None: whole tensor)."""
    a = b.op("Abs", x)
    isnan = b.op("IsNaN", a)
    clean = b.op("Where", isnan, b.const(0.0), a)
    nan_f = b.op("Cast", isnan, to=TensorProto.FLOAT)
    if axes is None:
        m, has = b.op("ReduceMax", clean, keepdims=0), b.op("ReduceMax", nan_f, keepdims=0)
    else:
        m, has = b.op("ReduceMax", clean, axes, keepdims=1), b.op("ReduceMax", nan_f, axes, keepdims=1)
    return b.op("Where", b.op("Cast", has, to=TensorProto.BOOL), b.const(np.nan), m)


# -- families --------------------------------------------------------------------------------
def shared_exponent(b: Body, amax: str, elem: ElementSpec, rule: str) -> str:
    """MX shared exponent for finite amax > 0, clamped to the E8M0 range (mx.shared_exponent)."""
    if rule == "floor":
        e = b.op("Sub", floor_log2(b, amax), b.const(elem.emax))
    elif rule == "ceil":
        e = b.op("Sub", ceil_log2(b, amax), b.const(elem.emax))
    elif rule == "rceil":
        v = b.op("Div", amax, b.const(elem.max_normal))
        pos = b.op("Greater", v, b.const(0.0))
        e = b.op("Where", pos, ceil_log2(b, b.op("Where", pos, v, b.const(1.0))), b.const(-127.0))
    elif rule == "even":
        # The reference adds half an element ulp to amax's bits (round half up on the bits);
        # adding 2^(max(fl, -126) - 1 - mbits) in fp32 crosses a power of two exactly when
        # that carry does, and overflows to +inf exactly when the bits reach the Inf pattern.
        fl = b.op("Max", floor_log2(b, amax), b.const(-126.0))
        half = pow2(b, b.op("Sub", fl, b.const(1.0 + elem.mbits)))
        e = b.op("Sub", floor_log2(b, b.op("Add", amax, half)), b.const(elem.emax))
    else:
        raise UnsupportedExport(f"unknown scale_rule {rule!r}")
    return b.op("Min", b.op("Max", e, b.const(-127.0)), b.const(127.0))


def mx_blocks(b: Body, x: str, axes: str, cfg: FakeQuantConfig) -> str:
    """quantize_mx on a blocked tensor (block maxima reduce over `axes`)."""
    elem = cfg.spec.element
    amax = amax_or_inf(b, x, axes)
    bad = b.op("IsInf", amax)
    zero = b.op("Equal", amax, b.const(0.0))
    safe = b.op("Where", b.op("Or", bad, zero), b.const(1.0), amax)
    e = b.op("Where", zero, b.const(-127.0), shared_exponent(b, safe, elem, cfg.scale_rule))
    scale = pow2(b, e)
    q = round_signed(b, b.op("Div", x, scale), elem, cfg.rounding)
    nan_or_one = b.op("Where", bad, b.const(np.nan), b.const(1.0))  # per block: keeps -0.0
    return b.op("Mul", b.op("Mul", q, scale), nan_or_one)


def int_blocks(b: Body, x: str, axes: str, cfg: FakeQuantConfig) -> str:
    """quantize_int: symmetric groups, scale amax / qmax."""
    elem = cfg.spec.element
    amax = amax_or_inf(b, x, axes)
    bad = b.op("IsInf", amax)
    scale = b.op("Where", bad, b.const(np.nan), b.op("Div", amax, b.const(float(elem.qmax))))
    div = b.op("Where", b.op("Or", b.op("Equal", scale, b.const(0.0)), bad), b.const(1.0), scale)
    q = round_signed(b, b.op("Div", x, div), elem, cfg.rounding)
    return b.op("Mul", q, scale)  # NaN scale: the reference's NaN q times NaN scale


def _e4m3(b: Body, v: str) -> str:
    return round_magnitude(b, v, E4M3, "rne")


def _clamp6(b: Body, y: str) -> str:
    return b.op("Max", b.op("Min", y, b.const(6.0)), b.const(-6.0))


def nvfp4_blocks(b: Body, x: str, axes: str, cfg: FakeQuantConfig) -> str:
    """quantize_nvfp4 in the variant's fp32 order of operations."""
    elem = cfg.spec.element
    if cfg.variant == "one_level":
        s = _e4m3(b, b.op("Min", b.op("Div", amax_nan(b, x, axes), b.const(6.0)), b.const(448.0)))
        sz = b.op("Equal", s, b.const(0.0))
        # where(s == 0, x * 0.0, x / s) without routing signed zeros through a Where
        div = b.op("Div", x, b.op("Where", sz, b.const(1.0), s))
        y = b.op("Mul", div, b.op("Where", sz, b.const(0.0), b.const(1.0)))
        return b.op("Mul", round_signed(b, _clamp6(b, y), elem, cfg.rounding), s)
    amax_t = amax_nan(b, x, None)
    if cfg.variant == "default":
        amax_b = amax_or_inf(b, x, axes)  # a NaN anywhere makes every output NaN through g
        g = b.op("Min", b.op("Div", b.const(2688.0), amax_t), b.const(FLT_MAX))
        g = b.op("Where", b.op("Equal", g, b.const(0.0)), b.const(1.0), g)
        d = b.op("Div", b.const(1.0), g)
        d = b.op("Min", d, b.const(FLT_MAX))  # no-op on values; stops Div(1,g)*s becoming s/g
        gs = b.op("Mul", g, b.const(np.float32(1 / 6)))
        s = b.op("Min", b.op("Mul", amax_b, gs), b.const(FLT_MAX))
        s = _e4m3(b, b.op("Max", b.op("Min", s, b.const(448.0)), b.const(-448.0)))
        sd = b.op("Mul", s, d)
        enc = b.op("Min", b.op("Div", b.const(1.0), sd), b.const(FLT_MAX))
        q = round_signed(b, _clamp6(b, b.op("Mul", x, enc)), elem, cfg.rounding)
        return b.op("Mul", q, sd)
    amax_b = amax_nan(b, x, axes)  # a NaN block is all NaN here (g ignores amax_t's NaN)
    recip = b.op("Min", b.op("Div", b.const(1.0), amax_t), b.const(np.inf))  # stops Div-Mul fusion
    g = b.op("Mul", recip, b.const(2688.0))
    g = b.op("Where", b.op("Or", b.op("IsNaN", g), b.op("IsInf", g)), b.const(1.0), g)
    s = b.op("Mul", g, b.op("Div", amax_b, b.const(6.0)))
    s = _e4m3(b, b.op("Max", b.op("Min", s, b.const(448.0)), b.const(-448.0)))
    s = b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(0.125), s)
    scale = b.op("Div", s, g)
    y = b.op("Div", x, scale)
    qa = round_magnitude(b, b.op("Abs", _clamp6(b, y)), elem, cfg.rounding)
    q = b.op("Mul", qa, b.op("Where", b.op("Less", y, b.const(0.0)), b.const(-1.0), b.const(1.0)))
    return b.op("Mul", q, scale)


FAMILIES: dict[str, Callable[[Body, str, str, FakeQuantConfig], str]] = {
    "mx": mx_blocks,
    "int": int_blocks,
    "nvfp4": nvfp4_blocks,
}


# -- blocking --------------------------------------------------------------------------------
def _ceil_div(b: Body, n: str, k: int) -> str:
    return b.op("Div", b.op("Add", n, b.ints(k - 1)), b.ints(k))


@dataclass
class BlockView:
    """x cut into zero-padded blocks: `xb` with block maxima reducing over `axes`."""

    xb: str
    axes: str
    unblock: Callable[[str], str]  # same shape as xb -> x's shape, padding dropped
    grid: Callable[[str], str] | None  # per-block values -> x's shape with the axis = n_blocks


def block_view(b: Body, x: str, cfg: FakeQuantConfig) -> BlockView:
    """x cut into blocks: with constant shapes when `cfg.static_blocks()`, else from Shape(x)."""
    return static_view(b, x, cfg) if cfg.static_blocks() else dynamic_view(b, x, cfg)


def static_view(b: Body, x: str, cfg: FakeQuantConfig) -> BlockView:
    """Blocks by Reshape with constant targets, leading dims copied (0): [..., nb, B, post...]
    or [..., mb, r, nb, c]. Every value keeps shapes onnxruntime can name (batch, sequence),
    without which its session setup (memory planning) grows quadratically with the graph."""
    assert cfg.shape is not None
    rank = len(cfg.shape)
    if cfg.tile:
        first, dims, blocks = rank - 2, [int(d) for d in cfg.shape[-2:]], list(cfg.tile)
    else:
        first, dims, blocks = cfg.axis % rank, [int(cfg.shape[cfg.axis % rank])], [cfg.block]
    post = [int(d) for d in cfg.shape[first + len(dims):]]
    counts = [-(-d // k) for d, k in zip(dims, blocks, strict=True)]
    padded = [n * k for n, k in zip(counts, blocks, strict=True)]
    xp = x
    if padded != dims:
        pads = [0] * (2 * rank)
        for i, (d, p) in enumerate(zip(dims, padded, strict=True)):
            pads[rank + first + i] = p - d
        xp = b.op("Pad", x, b.ints(*pads))
    split = [v for n, k in zip(counts, blocks, strict=True) for v in (n, k)]
    xb = b.op("Reshape", xp, b.ints(*([0] * first), *split, *post))
    axes = [first + 1 + 2 * i for i in range(len(dims))]

    def unblock(out: str) -> str:
        out = b.op("Reshape", out, b.ints(*([0] * first), *padded, *post))
        if padded == dims:
            return out
        where = list(range(first, first + len(dims)))
        return b.op("Slice", out, b.ints(*[0] * len(dims)), b.ints(*dims), b.ints(*where))

    def grid(per_block: str) -> str:
        return b.op("Squeeze", per_block, b.ints(*axes))

    return BlockView(xb, b.ints(*axes), unblock, None if cfg.tile else grid)


def dynamic_view(b: Body, x: str, cfg: FakeQuantConfig) -> BlockView:
    """1D: x -> [pre, L, post] -> pad L per row -> [pre, nb, B, post], blocks reduce over axis 2,
    so no transpose is needed for any axis. Tiles: [lead, m, n] -> [P, mb, r, nb, c], axes 2, 4."""
    shape = b.op("Shape", x)
    zero, end = b.ints(0), b.ints(2**62)
    if cfg.tile:
        r, c = cfg.tile
        m, n = b.op("Slice", shape, b.ints(-2), b.ints(-1)), b.op("Slice", shape, b.ints(-1), end)
        x3 = b.op("Reshape", x, b.op("Concat", b.ints(-1), m, n, axis=0))
        mb, nb = _ceil_div(b, m, r), _ceil_div(b, n, c)
        pad_m, pad_n = b.op("Sub", b.op("Mul", mb, b.ints(r)), m), b.op("Sub", b.op("Mul", nb, b.ints(c)), n)
        xp = b.op("Pad", x3, b.op("Concat", zero, zero, zero, zero, pad_m, pad_n, axis=0))
        xb = b.op("Reshape", xp, b.op("Concat", b.ints(-1), mb, b.ints(r), nb, b.ints(c), axis=0))

        def untile(out: str) -> str:
            out = b.op("Reshape", out, b.op("Shape", xp))
            out = b.op("Slice", out, b.ints(0, 0), b.op("Concat", m, n, axis=0), b.ints(1, 2))
            return b.op("Reshape", out, shape)

        return BlockView(xb, b.ints(2, 4), untile, None)
    axis, block = cfg.axis, cfg.block
    pre = b.op("Slice", shape, zero, b.ints(axis))
    length = b.op("Slice", shape, b.ints(axis), b.ints(axis + 1) if axis != -1 else end)
    post_dims = None if axis == -1 else b.op("Slice", shape, b.ints(axis + 1), end)
    post = b.ints(1) if post_dims is None else b.op("ReduceProd", post_dims, keepdims=1)
    p = b.op("ReduceProd", pre, keepdims=1)
    x3 = b.op("Reshape", x, b.op("Concat", p, length, post, axis=0))
    nb = _ceil_div(b, length, block)
    pad = b.op("Sub", b.op("Mul", nb, b.ints(block)), length)
    xp = b.op("Pad", x3, b.op("Concat", zero, zero, zero, zero, pad, zero, axis=0))
    xb = b.op("Reshape", xp, b.op("Concat", p, nb, b.ints(block), post, axis=0))

    def unblock(out: str) -> str:
        out = b.op("Slice", b.op("Reshape", out, b.op("Shape", xp)), zero, length, b.ints(1))
        return b.op("Reshape", out, shape)

    def grid(per_block: str) -> str:
        dims = (pre, nb) if post_dims is None else (pre, nb, post_dims)
        return b.op("Reshape", per_block, b.op("Concat", *dims, axis=0))

    return BlockView(xb, b.ints(2), unblock, grid)


def fake_quant_body(cfg: FakeQuantConfig) -> Body:
    """Nodes computing Y = fake_quantize(X, cfg) in X's dtype (X: any float type, rank >= 1)."""
    b = Body()
    family = FAMILIES[cfg.spec.family]
    view = block_view(b, b.op("Cast", "X", to=TensorProto.FLOAT), cfg)
    out = view.unblock(family(b, view.xb, view.axes, cfg))
    b.nodes.append(helper.make_node("CastLike", [out, "X"], ["Y"]))
    return b


def fake_quant_function(cfg: FakeQuantConfig, opset: int) -> FunctionProto:
    """The model-local function for one (op_type, attributes) of fake-quant."""
    body = fake_quant_body(cfg)
    return helper.make_function(
        DOMAIN, cfg.spec.onnx_op, ["X"], ["Y"], body.nodes, [helper.make_opsetid("", opset)],
        attributes=list(cfg.attributes()), doc_string=f"{cfg.spec.name}: {cfg.spec.description}",
        overload=cfg.overload(),
    )
