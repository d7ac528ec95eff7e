"""The backward GEMMs of a fake-quantized Linear, per role.

By default a fake-quantized Linear's gradient is the straight-through estimator through the
forward's quantized operands: dX = G·Q(W), dW = Gᵀ·Q(X), G unquantized ("dequantized"). A
quantize rule's `backward` can ask for more, as low-precision training stacks do:

- "high_precision": the backward GEMMs use the operands before quantization:
  dX = G·W, dW = Gᵀ·X (the gradients of the unquantized Linear at the quantized forward);
- "quantized": every operand of each backward GEMM is fake-quantized in blocks along that GEMM's
  reduction axis: dgrad dX = Q_g(G)·Q_w(W), G and W blocked along the output features; wgrad
  dW = Q_g(Gᵀ)·Q_x(Xᵀ)ᵀ, G and X blocked along the tokens (batch and sequence flattened), after an
  optional Hadamard rotation of both along the tokens (R orthogonal, so (GᵀR)(XᵀR)ᵀ = GᵀX in
  exact arithmetic; Transformer Engine's RHT).

Each operand is quantized as the matrix with its GEMM's reduction axis last: G [N, out] and Wᵀ
[in, out] for dgrad, Gᵀ [out, N] and Xᵀ [in, N] for wgrad (contiguous; stochastic rounding draws
at the element positions of that matrix). A role left out stays unquantized; the weight role
"forward" reuses the forward's quantized weight as it is (one copy for both orientations, exact
for 2-D tiles). Tokens are zero-padded to a multiple of the Hadamard block (zero rows add
nothing to dW). The bias gradient is the sum of the unquantized G.

Stochastic rounding draws from the Philox stream of the forward's stochastic rounding
(`core.streams.DrawStream`, one per role operand: `<label>/grad_dgrad`, `grad_wgrad`,
`weight_dgrad`, `input_wgrad`): the draw index is taken when the forward runs, so each backward
call has its own draws and a forward recomputed by gradient checkpointing replays them. A
Hadamard with `redraw` takes new signs for every backward call the same way, from the stream
`<label>/hadamard` (one draw for the dgrad and the wgrad rotation of a call: with equal seeds
they share their signs, as Quartet II re-draws one rotation per backward). A role with an EDEN
quantizer (`formats.eden.Eden`, Quartet II) draws its block scales from its operand's stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.streams import DrawStream, site_seed
from qtransform.formats import QuantConfig
from qtransform.formats.eden import Eden
from qtransform.formats.hadamard import random_signs, rotate

MODES = ("dequantized", "high_precision", "quantized")
OPERANDS = ("grad_dgrad", "grad_wgrad", "weight_dgrad", "input_wgrad")
HADAMARD_STREAM = "hadamard"  # the stream of re-drawn Hadamard signs (dgrad and wgrad share it)


@dataclass(frozen=True)
class Hadamard:
    """The rotation of both wgrad operands along the tokens: `kind` "hadamard" or
    "random_hadamard", whose signs are `fixed` (a stack's own vector, e.g. Transformer Engine's)
    or `formats.hadamard.random_signs(block, seed)`; with `redraw` they are
    `random_signs(block, s)` for the per-call seed s of the site's `hadamard` stream."""

    kind: str
    block: int
    seed: int = 0
    fixed: tuple[int, ...] | None = None
    redraw: bool = False

    def signs(self, device: torch.device, call_seed: int | None = None) -> Tensor | None:
        if self.kind != "random_hadamard":
            return None
        if self.fixed is not None:
            return torch.tensor(self.fixed, dtype=torch.float32, device=device)
        if self.redraw:
            assert call_seed is not None
            return random_signs(self.block, call_seed, device)
        return _signs(self.block, self.seed, device)


@functools.lru_cache(maxsize=64)
def _signs(block: int, seed: int, device: torch.device) -> Tensor:
    """`random_signs`, computed once per (block, seed, device): it is the same every backward
    (read only; a Philox evaluation per call cost as much as the rotation)."""
    return random_signs(block, seed, device)


@dataclass(frozen=True)
class BackwardSpec:
    """What a site's backward GEMMs compute. `grad`, `weight`, `input` are the role configs
    (None: that operand stays unquantized; `weight` "forward": the forward's quantized weight;
    an `Eden`: Quartet II's quantizer); only "quantized" uses them and `hadamard`."""

    mode: str
    grad: QuantConfig | Eden | None = None
    weight: QuantConfig | Eden | str | None = None
    input: QuantConfig | Eden | None = None
    hadamard: Hadamard | None = None
    grad_wgrad: QuantConfig | Eden | str | None = "same"  # G in wgrad: "same" = `grad`
    # the roles ("weight", "input") quantized from the forward's quantized copy, not from x / w
    requantize: frozenset[str] = frozenset()
    dgrad_hadamard: Hadamard | None = None  # G and Wᵀ rotated along the output features

    def config(self, operand: str) -> QuantConfig | Eden | None:
        """The config of one operand (OPERANDS), bound to its last axis; None if unquantized."""
        cfg = {"grad_dgrad": self.grad, "input_wgrad": self.input,
               "grad_wgrad": self.grad if self.grad_wgrad == "same" else self.grad_wgrad,
               "weight_dgrad": None if self.weight == "forward" else self.weight}[operand]
        assert not isinstance(cfg, str)
        return cfg.bind(-1) if isinstance(cfg, QuantConfig) else cfg

    def redrawn(self) -> dict[str, int]:
        """The seed of each rotation ("dgrad_hadamard", "wgrad_hadamard") whose signs are
        re-drawn every backward call."""
        return {name: h.seed for name, h in (("dgrad_hadamard", self.dgrad_hadamard),
                                             ("wgrad_hadamard", self.hadamard))
                if h is not None and h.redraw}

    def describe(self) -> str:
        """One clause for plans."""
        if self.mode != "quantized":
            return f"backward {self.mode}"
        parts = []
        for role in ("grad", "weight", "input"):
            cfg = getattr(self, role)
            text = ("unquantized" if cfg is None else "the forward's quantized copy"
                    if isinstance(cfg, str) else cfg.describe())
            if role in self.requantize:
                text += " of the forward's quantized copy"
            parts.append(f"{role} {text}")
        if self.grad_wgrad != "same":
            cfg = self.config("grad_wgrad")
            parts.append(f"grad in wgrad {'unquantized' if cfg is None else cfg.describe()}")
        if self.hadamard is not None:
            fixed = ", fixed signs" if self.hadamard.fixed is not None else ""
            fixed += ", new signs every call" if self.hadamard.redraw else ""
            parts.append(f"wgrad {self.hadamard.kind} {self.hadamard.block}{fixed}")
        if self.dgrad_hadamard is not None:
            redraw = ", new signs every call" if self.dgrad_hadamard.redraw else ""
            parts.append(f"dgrad {self.dgrad_hadamard.kind} {self.dgrad_hadamard.block}{redraw}")
        return "backward quantized (" + "; ".join(parts) + ")"


def _quantize(x: Tensor, cfg: QuantConfig | Eden | None, seed: int | None) -> Tensor:
    """x fake-quantized along its last axis (contiguous), or x itself for an unquantized role."""
    if cfg is None:
        return x
    if isinstance(cfg, Eden):
        return cfg.quantize(x.contiguous(), seed)
    return formats.fake_quantize(x.contiguous(), cfg, seed=seed if cfg.stochastic else None)


def _pad_tokens(x: Tensor, block: int) -> Tensor:
    """x [rows, N] zero-padded along N to a multiple of `block`, contiguous (a transposed view
    made the rotation's blockwise matmul 4x slower)."""
    extra = -x.shape[-1] % block
    return F.pad(x, (0, extra)) if extra else x.contiguous()


def backward_grads(spec: BackwardSpec, grad: Tensor, x: Tensor, w: Tensor, wq: Tensor | None,
                   seeds: dict[str, int], need: tuple[bool, bool, bool],
                   transposed: bool = False, xq: Tensor | None = None) -> tuple[Tensor | None, ...]:
    """(dX, dW, dB) of y = x·Wᵀ + b for the upstream gradient `grad`, per `spec`; x and w are the
    operands before the forward's quantization, wq and xq the forward's quantized weight and
    input (needed for weight "forward" and the roles in `spec.requantize`); `need` says
    which of the three are wanted; `transposed`: w is stored [in, out] (GPT-2's Conv1D, y =
    addmm(b, x, w)). Written with the ops torch's own linear / addmm backward uses (G·W and
    Gᵀ·X, or Xᵀ·G, as mm), so "high_precision" equals the unquantized op's gradients."""
    w_lin = w.t() if transposed else w  # [out, in]
    wq_lin = None if wq is None else (wq.t() if transposed else wq)
    out_features, in_features = w_lin.shape
    g2, x2 = grad.reshape(-1, out_features), x.reshape(-1, in_features)
    if "input" in spec.requantize:
        assert xq is not None
        x2 = xq.reshape(-1, in_features)
    if "weight" in spec.requantize:
        assert wq_lin is not None
        w_lin = wq_lin
    dx = dw = db = None
    if spec.mode == "high_precision":
        if need[0]:
            dx = g2.mm(w_lin)
        if need[1]:
            dw = x2.t().mm(g2) if transposed else g2.t().mm(x2)
    else:
        if need[0]:
            gd, wt = g2, (wq_lin if spec.weight == "forward" else w_lin).t()
            if spec.dgrad_hadamard is not None:  # (G·R)(Wᵀ·R)ᵀ = G·W: only the quantization sees R
                h = spec.dgrad_hadamard
                if out_features % h.block:
                    raise ValueError(f"dgrad_hadamard: a block of {h.block} does not divide the "
                                     f"{out_features} output features")
                signs = h.signs(grad.device, seeds.get("dgrad_hadamard"))
                gd, wt = rotate(g2, h.block, signs), rotate(wt.contiguous(), h.block, signs)
            gq = _quantize(gd, spec.config("grad_dgrad"), seeds.get("grad_dgrad"))
            if spec.weight != "forward":
                wt = _quantize(wt, spec.config("weight_dgrad"), seeds.get("weight_dgrad"))
            dx = gq.mm(wt.t())
        if need[1]:
            gt, xt = g2.t(), x2.t()
            if spec.hadamard is not None:
                h = spec.hadamard
                signs = h.signs(grad.device, seeds.get("wgrad_hadamard"))
                gt = rotate(_pad_tokens(gt, h.block), h.block, signs)
                xt = rotate(_pad_tokens(xt, h.block), h.block, signs)
            gtq = _quantize(gt, spec.config("grad_wgrad"), seeds.get("grad_wgrad"))
            xtq = _quantize(xt, spec.config("input_wgrad"), seeds.get("input_wgrad"))
            dw = xtq.mm(gtq.t()) if transposed else gtq.mm(xtq.t())
    if dx is not None:
        dx = dx.reshape(x.shape)
    if need[2]:
        db = g2.sum(0)
    return dx, dw, db


def _op(xq: Tensor, wq: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    """The site's own forward op: linear(x, W, b), or Conv1D's addmm(b, x, W) (W [in, out])."""
    if transposed:
        return torch.addmm(bias, xq, wq) if bias is not None else xq.mm(wq)
    return F.linear(xq, wq, bias)


class _Linear(torch.autograd.Function):
    """y = linear(xq, wq, b) (the forward's quantized operands); the gradient goes to x, w and b
    as `backward_grads` computes it, none to xq and wq (their straight-through path is this)."""

    @staticmethod
    def forward(ctx, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor,  # type: ignore[override]
                spec: BackwardSpec, seeds: dict[str, int], transposed: bool) -> Tensor:
        ctx.spec, ctx.seeds, ctx.has_bias = spec, seeds, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        device = xq.device.type
        # under autocast the forward GEMM ran in its dtype: so do the backward GEMMs
        ctx.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        ctx.transposed = transposed
        keep_wq = spec.weight == "forward" or "weight" in spec.requantize
        ctx.save_for_backward(x, w, wq if keep_wq else None, xq if "input" in spec.requantize else None)
        return _op(xq, wq, bias, transposed)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, w, wq, xq = ctx.saved_tensors
        need = (ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.has_bias and ctx.needs_input_grad[2])
        dtypes = (x.dtype, w.dtype)
        if ctx.autocast is not None:  # the operands as autocast handed them to the forward GEMM
            x, w = x.to(ctx.autocast), w.to(ctx.autocast)
            wq = None if wq is None else wq.to(ctx.autocast)
            xq = None if xq is None else xq.to(ctx.autocast)
        dx, dw, db = backward_grads(ctx.spec, grad, x, w, wq, ctx.seeds, need, ctx.transposed, xq)
        if ctx.autocast is not None:
            dx = None if dx is None else dx.to(dtypes[0])
            dw = None if dw is None else dw.to(dtypes[1])
            db = None if db is None else db.to(ctx.bias_dtype)
        return None, None, db, dx, dw, None, None, None


class BackwardLinear(nn.Module):
    """The Linear op (or Conv1D's addmm) of a site whose quantize rule asks for another backward:
    called as `(xq, wq, bias, x, w)` in place of `linear(xq, wq, bias)` (the same forward bits),
    with x and w the operands before the fake-quants. Traced (export) it is that plain linear:
    the forward is all a graph carries. Under torch.compile it runs eagerly (a graph break)."""

    def __init__(self, spec: BackwardSpec, label: str, transposed: bool = False):
        super().__init__()
        self.spec = spec
        self.label = label
        self.transposed = transposed  # Conv1D: W stored [in, out], the op is addmm(b, x, W)
        self._roles = {op: cfg.seed or 0 for op in OPERANDS
                       if spec.mode == "quantized" and (cfg := spec.config(op)) is not None and cfg.stochastic}
        self._roles |= spec.redrawn()
        # one draw index per forward for every stochastic operand (None: nothing is drawn)
        self.stream = DrawStream(0, label) if self._roles else None

    def extra_repr(self) -> str:
        return f"{self.spec.describe()}, label={self.label!r}"

    def set_step(self, step: int, draws: int = 0) -> None:
        """Go to training step `step`: the draws of stochastic gradient rounding are redone."""
        if self.stream is not None:
            self.stream.set_step(step, draws)

    def seeds(self) -> dict[str, int]:
        """This forward's Philox seed per stochastic operand: draw `index` of the stream
        `DrawStream(role seed, "<label>/<operand>")` at the current step, the index shared by the
        operands (replayed when gradient checkpointing recomputes the forward); re-drawn
        Hadamards take theirs from `<label>/hadamard`."""
        if self.stream is None:
            return {}
        s = self.stream
        index = s.next_index(self.training)
        return {op: site_seed(seed, f"{s.key}/{HADAMARD_STREAM if op.endswith('hadamard') else op}",
                              s.step, index) for op, seed in self._roles.items()}

    def forward(self, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor) -> Tensor:
        if ops.is_tracing(xq) and not torch.compiler.is_compiling():
            return _op(xq, wq, bias, self.transposed)
        return self._eager(xq, wq, bias, x, w)

    @torch.compiler.disable
    def _eager(self, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor) -> Tensor:
        seeds = self.seeds()  # taken by every forward, as the forward's stochastic rounding does
        if not torch.is_grad_enabled():
            return _op(xq, wq, bias, self.transposed)
        return _Linear.apply(xq, wq, bias, x, w, self.spec, seeds, self.transposed)
