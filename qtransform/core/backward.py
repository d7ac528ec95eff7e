"""The backward GEMMs of a fake-quantized Linear, per role (issue 32).

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
call has its own draws and a forward recomputed by gradient checkpointing replays them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.streams import DrawStream, site_seed
from qtransform.formats import QuantConfig
from qtransform.formats.hadamard import random_signs, rotate

MODES = ("dequantized", "high_precision", "quantized")
OPERANDS = ("grad_dgrad", "grad_wgrad", "weight_dgrad", "input_wgrad")


@dataclass(frozen=True)
class Hadamard:
    """The rotation of both wgrad operands along the tokens: `kind` "hadamard" or
    "random_hadamard" (signs from `formats.hadamard.random_signs(block, seed)`)."""

    kind: str
    block: int
    seed: int = 0

    def signs(self, device: torch.device) -> Tensor | None:
        return random_signs(self.block, self.seed, device) if self.kind == "random_hadamard" else None


@dataclass(frozen=True)
class BackwardSpec:
    """What a site's backward GEMMs compute. `grad`, `weight`, `input` are the role configs
    (None: that operand stays unquantized; `weight` "forward": the forward's quantized weight);
    only "quantized" uses them and `hadamard`."""

    mode: str
    grad: QuantConfig | None = None
    weight: QuantConfig | str | None = None
    input: QuantConfig | None = None
    hadamard: Hadamard | None = None

    def config(self, operand: str) -> QuantConfig | None:
        """The config of one operand (OPERANDS), bound to its last axis; None if unquantized."""
        cfg = {"grad_dgrad": self.grad, "grad_wgrad": self.grad, "input_wgrad": self.input,
               "weight_dgrad": None if self.weight == "forward" else self.weight}[operand]
        assert not isinstance(cfg, str)
        return None if cfg is None else cfg.bind(-1)

    def describe(self) -> str:
        """One clause for plans."""
        if self.mode != "quantized":
            return f"backward {self.mode}"
        parts = []
        for role in ("grad", "weight", "input"):
            cfg = getattr(self, role)
            text = ("unquantized" if cfg is None else "the forward's quantized copy"
                    if isinstance(cfg, str) else cfg.describe())
            parts.append(f"{role} {text}")
        if self.hadamard is not None:
            parts.append(f"wgrad {self.hadamard.kind} {self.hadamard.block}")
        return "backward quantized (" + "; ".join(parts) + ")"


def _quantize(x: Tensor, cfg: QuantConfig | None, seed: int | None) -> Tensor:
    """x fake-quantized along its last axis (contiguous), or x itself for an unquantized role."""
    if cfg is None:
        return x
    return formats.fake_quantize(x.contiguous(), cfg, seed=seed if cfg.stochastic else None)


def _pad_tokens(x: Tensor, block: int) -> Tensor:
    """x [rows, N] zero-padded along N to a multiple of `block`."""
    extra = -x.shape[-1] % block
    return F.pad(x, (0, extra)) if extra else x


def backward_grads(spec: BackwardSpec, grad: Tensor, x: Tensor, w: Tensor, wq: Tensor,
                   seeds: dict[str, int], need: tuple[bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """(dX, dW, dB) of y = x·Wᵀ + b for the upstream gradient `grad`, per `spec`; x and w are the
    operands before the forward's quantization, wq the forward's quantized weight; `need` says
    which of the three are wanted. Written with the ops torch's own linear backward uses
    (G·W as mm, Gᵀ·X as mm), so "high_precision" equals the unquantized Linear's gradients."""
    out_features = w.shape[0]
    g2 = grad.reshape(-1, out_features)
    dx = dw = db = None
    if spec.mode == "high_precision":
        if need[0]:
            dx = g2.mm(w).reshape(*grad.shape[:-1], w.shape[1])
        if need[1]:
            dw = g2.t().mm(x.reshape(-1, w.shape[1]))
    else:
        if need[0]:
            gq = _quantize(g2, spec.config("grad_dgrad"), seeds.get("grad_dgrad"))
            if spec.weight == "forward":
                dx = gq.mm(wq)
            else:
                wt = _quantize(w.t(), spec.config("weight_dgrad"), seeds.get("weight_dgrad"))
                dx = gq.mm(wt.t())
            dx = dx.reshape(*grad.shape[:-1], w.shape[1])
        if need[1]:
            gt, xt = g2.t(), x.reshape(-1, w.shape[1]).t()
            if spec.hadamard is not None:
                h = spec.hadamard
                signs = h.signs(grad.device)
                gt = rotate(_pad_tokens(gt, h.block), h.block, signs)
                xt = rotate(_pad_tokens(xt, h.block), h.block, signs)
            gtq = _quantize(gt, spec.config("grad_wgrad"), seeds.get("grad_wgrad"))
            xtq = _quantize(xt, spec.config("input_wgrad"), seeds.get("input_wgrad"))
            dw = gtq.mm(xtq.t())
    if need[2]:
        db = g2.sum(0)
    return dx, dw, db


class _Linear(torch.autograd.Function):
    """y = linear(xq, wq, b) (the forward's quantized operands); the gradient goes to x, w and b
    as `backward_grads` computes it, none to xq and wq (their straight-through path is this)."""

    @staticmethod
    def forward(ctx, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor,  # type: ignore[override]
                spec: BackwardSpec, seeds: dict[str, int]) -> Tensor:
        ctx.spec, ctx.seeds, ctx.has_bias = spec, seeds, bias is not None
        ctx.save_for_backward(x, w, wq if spec.weight == "forward" else None)
        return F.linear(xq, wq, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, w, wq = ctx.saved_tensors
        need = (ctx.needs_input_grad[3], ctx.needs_input_grad[4], ctx.has_bias and ctx.needs_input_grad[2])
        dx, dw, db = backward_grads(ctx.spec, grad, x, w, wq, ctx.seeds, need)
        return None, None, db, dx, dw, None, None


class BackwardLinear(nn.Module):
    """The Linear op of a site whose quantize rule asks for another backward than the default:
    called as `(xq, wq, bias, x, w)` in place of `linear(xq, wq, bias)` (the same forward bits),
    with x and w the operands before the fake-quants. Traced (export) it is that plain linear:
    the forward is all a graph carries. Under torch.compile it runs eagerly (a graph break)."""

    def __init__(self, spec: BackwardSpec, label: str):
        super().__init__()
        self.spec = spec
        self.label = label
        self._roles = {op: cfg.seed or 0 for op in OPERANDS
                       if spec.mode == "quantized" and (cfg := spec.config(op)) is not None and cfg.stochastic}
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
        operands (replayed when gradient checkpointing recomputes the forward)."""
        if self.stream is None:
            return {}
        s = self.stream
        index = s.next_index(self.training)
        return {op: site_seed(seed, f"{s.key}/{op}", s.step, index) for op, seed in self._roles.items()}

    def forward(self, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor) -> Tensor:
        if ops.is_tracing(xq) and not torch.compiler.is_compiling():
            return F.linear(xq, wq, bias)
        return self._eager(xq, wq, bias, x, w)

    @torch.compiler.disable
    def _eager(self, xq: Tensor, wq: Tensor, bias: Tensor | None, x: Tensor, w: Tensor) -> Tensor:
        seeds = self.seeds()  # taken by every forward, as the forward's stochastic rounding does
        if not torch.is_grad_enabled():
            return F.linear(xq, wq, bias)
        return _Linear.apply(xq, wq, bias, x, w, self.spec, seeds)
