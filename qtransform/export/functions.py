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
from numpy.typing import ArrayLike, DTypeLike
from onnx import FunctionProto, NodeProto, TensorProto, helper, numpy_helper

from qtransform.errors import UserError
from qtransform.formats.options import WHOLE_ROW, QuantConfig
from qtransform.formats.registry import ElementSpec

DOMAIN = "qtransform"
FLT_MAX = float(np.finfo(np.float32).max)
POW2_MIN, POW2_MAX = -149, 128  # table range of exact powers of two (2^128 reads +inf)


class ExportError(UserError):
    """The model could not be exported; the message names the op or site that failed."""


class UnsupportedExport(ValueError):
    """A fake-quant configuration that has no ONNX body (names the format and option)."""


Shape = tuple[int | None, ...] | None  # a node input's static dims (None where symbolic)


def attributes(cfg: QuantConfig) -> dict[str, Any]:
    """The node attributes of a fake-quant node: every option that changes the numbers
    (`QuantConfig.numerics`, the axis always bound)."""
    return cfg.bind(cfg.block_axis).numerics()


def overload(cfg: QuantConfig, shape: Shape = None, extra: dict[str, Any] | None = None) -> str:
    """A stable identifier of the attributes (a fixed global amax or stored tensor scale by its
    fp32 bits) and, for
    static bodies, the input shape (the function's IR 10 overload name)."""
    block = "x".join(map(str, cfg.tile)) if cfg.tile else str(cfg.block or cfg.granularity)
    parts = [f"b{block}", f"axis{cfg.block_axis}".replace("-", "m"), cfg.rounding]
    parts += [value.replace("-", "_") for o in cfg.family.options if o != "rounding"
              and ((value := getattr(cfg, o)) != cfg.family.default(o) or o not in cfg.family.quiet)]
    if static_blocks(cfg, shape):
        parts.append("s" + "x".join("d" if d is None else str(d) for d in shape or ()))
    extra = extra or {}
    if "global_amax" in extra:
        parts.append("ga" + np.float32(extra["global_amax"]).view(np.uint32).tobytes().hex())
    if "tensor_scale" in extra:
        parts.append("ts" + np.float32(extra["tensor_scale"]).view(np.uint32).tobytes().hex())
    if extra.get("global_scale") == "token":
        parts.append("gtoken")
    return "_".join(parts)


def static_blocks(cfg: QuantConfig, shape: Shape) -> bool:
    """True when the blocked dims (and every dim after a 1D blocking axis) are static."""
    if not shape:
        return False
    rank = len(shape)
    if cfg.tile:
        return rank >= 2 and None not in shape[-2:]
    axis = cfg.block_axis
    return -rank <= axis < rank and None not in shape[axis % rank:]


@dataclass(frozen=True)
class OnnxFamily:
    """The ONNX half of a format family, registered under the family's name by its module in
    `qtransform.export.families`: the function body and the QDQ form.

    `blocks(b, xb, axes, cfg)` fake-quantizes blocked fp32 values (block maxima reduce over
    `axes`); a family with a tensor-level scale also takes `amax_t` (a given amax) or
    `scale_t=` (a stored tensor scale, used as it is). For QDQ, `weight_scale(label, grid, tensor_scale, cfg)` gives the initializers and
    nodes that produce `<label>/scale` from the encoded weight's scales, and
    `activation_scale(b, amax, cfg)` the per-block scale computed in the graph from block
    maxima (+inf marks a NaN/Inf block), cast to `activation_scale_type` if set. A family
    without the two QDQ hooks exports in the function and inline modes only.
    """

    blocks: Callable[[Body, str, str, QuantConfig], str]
    weight_scale: Callable[[str, Any, Any, QuantConfig], tuple[list[TensorProto], list[NodeProto]]] | None = None
    activation_scale: Callable[[Body, str, QuantConfig], str] | None = None
    activation_scale_type: int | None = None


_ONNX_FAMILIES: dict[str, OnnxFamily] = {}


def register_onnx_family(name: str, family: OnnxFamily) -> OnnxFamily:
    """Give the format family `name` (of `qtransform.formats`) its ONNX form."""
    if name in _ONNX_FAMILIES:
        raise ValueError(f"family {name!r} already has an ONNX form")
    _ONNX_FAMILIES[name] = family
    return family


def onnx_family_names() -> tuple[str, ...]:
    """The families that have an ONNX form."""
    return tuple(_ONNX_FAMILIES)


def onnx_family(cfg: QuantConfig) -> OnnxFamily:
    """The ONNX form of cfg's family; UnsupportedExport when it has none."""
    family = _ONNX_FAMILIES.get(cfg.family.name)
    if family is None:
        raise UnsupportedExport(f"{cfg.name}: the {cfg.family.name} family has no ONNX form")
    return family


def initializer(name: str, values: np.ndarray) -> TensorProto:
    """A graph initializer holding `values` (any dtype onnx.numpy_helper writes)."""
    return numpy_helper.from_array(np.ascontiguousarray(values), name)


@dataclass
class Body:
    """Nodes of one function body; every op returns the name of its (first) output."""

    nodes: list[NodeProto] = field(default_factory=list)
    _count: int = 0

    def _name(self, op_type: str) -> str:
        self._count += 1
        return f"{op_type.lower()}_{self._count}"

    def op(self, op_type: str, *inputs: str, **attrs: object) -> str:
        out = self._name(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def const(self, value: ArrayLike, dtype: DTypeLike = np.float32) -> str:
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
    """Round non-negative t: half-to-even (ONNX Round), half away (floor(t + 0.5)) or toward
    zero (Floor)."""
    if rounding == "rne":
        return b.op("Round", t)
    if rounding == "rna":
        return b.op("Floor", b.op("Add", t, b.const(0.5)))
    if rounding == "rtz":
        return b.op("Floor", t)
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
    elif rule in ("even", "compressed-tensors"):
        # The reference adds half an element ulp to amax's bits (round half up on the bits);
        # adding 2^(max(fl, -126) - 1 - mbits) in fp32 crosses a power of two exactly when
        # that carry does, and overflows to +inf exactly when the bits reach the Inf pattern.
        # "compressed-tensors" rounds at E2M1's 1 mantissa bit whatever the element.
        mbits = elem.mbits if rule == "even" else 1
        fl = b.op("Max", floor_log2(b, amax), b.const(-126.0))
        half = pow2(b, b.op("Sub", fl, b.const(1.0 + mbits)))
        e = b.op("Sub", floor_log2(b, b.op("Add", amax, half)), b.const(elem.emax))
    else:
        raise UnsupportedExport(f"unknown scale_rule {rule!r}")
    return b.op("Min", b.op("Max", e, b.const(-127.0)), b.const(127.0))


# -- blocking --------------------------------------------------------------------------------
def _ceil_div(b: Body, n: str, k: str) -> str:
    return b.op("Div", b.op("Sub", b.op("Add", n, k), b.ints(1)), k)


@dataclass
class BlockView:
    """x cut into zero-padded blocks: `xb` with block maxima reducing over `axes`."""

    xb: str
    axes: str
    unblock: Callable[[str], str]  # same shape as xb -> x's shape, padding dropped
    grid: Callable[[str], str] | None  # per-block values -> x's shape with the axis = n_blocks
    row_axes: str | None = None  # 1D blocks: the (n_blocks, block) axes of one row


def block_view(b: Body, x: str, cfg: QuantConfig, shape: Shape = None) -> BlockView:
    """x cut into blocks: with constant shapes when `static_blocks`, else from Shape(x)."""
    return static_view(b, x, cfg, shape) if static_blocks(cfg, shape) else dynamic_view(b, x, cfg)


def static_view(b: Body, x: str, cfg: QuantConfig, shape: Shape) -> BlockView:
    """Blocks by Reshape with constant targets, leading dims copied (0): [..., nb, B, post...]
    or [..., mb, r, nb, c]. Every value keeps shapes onnxruntime can name (batch, sequence),
    without which its session setup (memory planning) grows quadratically with the graph."""
    assert shape is not None
    rank = len(shape)
    if cfg.tile:
        first, dims, blocks = rank - 2, [int(d) for d in shape[-2:]], list(cfg.tile)
    else:
        first = cfg.block_axis % rank
        dims = [int(shape[first])]  # type: ignore[arg-type]
        blocks = [dims[0] if cfg.granularity in WHOLE_ROW else cfg.block]
    blocks = [min(k, max(d, 1)) for d, k in zip(dims, blocks, strict=True)]  # as make_layout
    post = [int(d) for d in shape[first + len(dims):]]  # type: ignore[arg-type]
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

    return BlockView(xb, b.ints(*axes), unblock, None if cfg.tile else grid,
                     None if cfg.tile else b.ints(first, first + 1))


def _clamped(b: Body, block: int, length: str) -> str:
    """min(block, max(length, 1)) as a 1-element int64 tensor: a block longer than its dim is cut
    to the dim (`blocking.make_layout`), so a huge block never pads a row to its size."""
    return b.op("Min", b.ints(block), b.op("Max", length, b.ints(1)))


def dynamic_view(b: Body, x: str, cfg: QuantConfig) -> BlockView:
    """1D: x -> [pre, L, post] -> pad L per row -> [pre, nb, B, post], blocks reduce over axis 2,
    so no transpose is needed for any axis. Tiles: [lead, m, n] -> [P, mb, r, nb, c], axes 2, 4.
    Block sides are clamped to their dim at run time, as the torch path clamps them."""
    shape = b.op("Shape", x)
    zero, end = b.ints(0), b.ints(2**62)
    if cfg.tile:
        m, n = b.op("Slice", shape, b.ints(-2), b.ints(-1)), b.op("Slice", shape, b.ints(-1), end)
        r, c = _clamped(b, cfg.tile[0], m), _clamped(b, cfg.tile[1], n)
        x3 = b.op("Reshape", x, b.op("Concat", b.ints(-1), m, n, axis=0))
        mb, nb = _ceil_div(b, m, r), _ceil_div(b, n, c)
        pad_m, pad_n = b.op("Sub", b.op("Mul", mb, r), m), b.op("Sub", b.op("Mul", nb, c), n)
        xp = b.op("Pad", x3, b.op("Concat", zero, zero, zero, zero, pad_m, pad_n, axis=0))
        xb = b.op("Reshape", xp, b.op("Concat", b.ints(-1), mb, r, nb, c, axis=0))

        def untile(out: str) -> str:
            out = b.op("Reshape", out, b.op("Shape", xp))
            out = b.op("Slice", out, b.ints(0, 0), b.op("Concat", m, n, axis=0), b.ints(1, 2))
            return b.op("Reshape", out, shape)

        return BlockView(xb, b.ints(2, 4), untile, None)
    axis = cfg.block_axis
    pre = b.op("Slice", shape, zero, b.ints(axis))
    length = b.op("Slice", shape, b.ints(axis), b.ints(axis + 1) if axis != -1 else end)
    post_dims = None if axis == -1 else b.op("Slice", shape, b.ints(axis + 1), end)
    post = b.ints(1) if post_dims is None else b.op("ReduceProd", post_dims, keepdims=1)
    p = b.op("ReduceProd", pre, keepdims=1)
    x3 = b.op("Reshape", x, b.op("Concat", p, length, post, axis=0))
    if cfg.granularity in WHOLE_ROW:
        block = b.op("Max", length, b.ints(1))
    else:
        block = _clamped(b, cfg.block, length)
    nb = _ceil_div(b, length, block)
    pad = b.op("Sub", b.op("Mul", nb, block), length)
    xp = b.op("Pad", x3, b.op("Concat", zero, zero, zero, zero, pad, zero, axis=0))
    xb = b.op("Reshape", xp, b.op("Concat", p, nb, block, post, axis=0))

    def unblock(out: str) -> str:
        out = b.op("Slice", b.op("Reshape", out, b.op("Shape", xp)), zero, length, b.ints(1))
        return b.op("Reshape", out, shape)

    def grid(per_block: str) -> str:
        dims = (pre, nb) if post_dims is None else (pre, nb, post_dims)
        return b.op("Reshape", per_block, b.op("Concat", *dims, axis=0))

    return BlockView(xb, b.ints(2), unblock, grid, b.ints(1, 2))


# a fake-quant whose tensor-level amax is not its input's own (passes/fake_quant.py): a fixed
# value (a calibrated static scale, a scale group's) or each row's (NVFP4 per-token); or whose
# tensor-level scale is a checkpoint's stored one ("tensor_scale", used as it is)
GLOBAL_ATTRS = ("global_amax", "global_scale", "tensor_scale")


def tensor_amax(b: Body, view: BlockView, extra: dict[str, Any]) -> str | None:
    """The tensor-level amax `extra` (GLOBAL_ATTRS) gives, broadcastable against `view.xb`;
    None for the input's own."""
    if "global_amax" in extra:
        return b.const(float(extra["global_amax"]))
    if extra.get("global_scale") == "token":
        if view.row_axes is None:
            raise UnsupportedExport("a per-token global scale needs 1D blocks")
        return amax_nan(b, view.xb, view.row_axes)
    return None


def fake_quant_body(cfg: QuantConfig, shape: Shape = None, extra: dict[str, Any] | None = None) -> Body:
    """Nodes computing Y = fake_quantize(X, cfg) in X's dtype (X: any float type, rank >= 1);
    `extra` (GLOBAL_ATTRS) replaces X's own tensor-level amax, or gives the stored tensor
    scale."""
    b = Body()
    family = onnx_family(cfg)
    view = block_view(b, b.op("Cast", "X", to=TensorProto.FLOAT), cfg, shape)
    extra = extra or {}
    amax_t = tensor_amax(b, view, extra)
    if "tensor_scale" in extra:
        out = family.blocks(b, view.xb, view.axes, cfg, None,  # type: ignore[call-arg]
                            scale_t=b.const(float(extra["tensor_scale"])))
    elif amax_t is None:
        out = family.blocks(b, view.xb, view.axes, cfg)
    else:
        out = family.blocks(b, view.xb, view.axes, cfg, amax_t)  # type: ignore[call-arg]
    out = view.unblock(out)
    b.nodes.append(helper.make_node("CastLike", [out, "X"], ["Y"]))
    return b


def fake_quant_function(cfg: QuantConfig, opset: int, shape: Shape = None,
                        extra: dict[str, Any] | None = None) -> FunctionProto:
    """The model-local function for one (op_type, attributes, static shape) of fake-quant."""
    extra = extra or {}
    body = fake_quant_body(cfg, shape, extra)
    return helper.make_function(
        DOMAIN, cfg.spec.onnx_op, ["X"], ["Y"], body.nodes, [helper.make_opsetid("", opset)],
        attributes=[*attributes(cfg), *extra], doc_string=f"{cfg.spec.name}: {cfg.spec.description}",
        overload=overload(cfg, shape, extra),
    )
