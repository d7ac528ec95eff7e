"""FP-Quant's presets (schemas/presets/fp_quant.py) against an independent implementation of what
docs/training.md says they compute: a Hadamard of `hadamard_group_size` on X and W along the input
features (written here as the butterfly the rotation documents, checked against scipy's matrix),
MXFP4/NVFP4 on the rotated operands, and each `backward_dtype`'s GEMMs by hand, rotated back."""

from __future__ import annotations

import copy
import math

import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from torch import nn

import qtransform
from qtransform import formats
from qtransform.formats import hadamard
from qtransform.models import build_tiny
from qtransform.schemas import PolicyError, load_policy

TOKENS, IN, OUT = 64, 128, 96


def by_hand_hadamard(x: torch.Tensor, b: int) -> torch.Tensor:
    """x·H_b/√b per block of b along the last axis, in the order docs/rotations.md documents: per
    stage h = 1, 2, .., b/2, element i of each pair (i, i + h) becomes a + c, element i + h becomes
    a − c; then one multiplication by fl32(1/√b). fp32 inside, x's dtype out."""
    v = x.to(torch.float32).reshape(-1, x.shape[-1]).clone()
    idx = torch.arange(x.shape[-1])
    h = 1
    while h < b:
        lo = idx[(idx // h) % 2 == 0]
        a, c = v[:, lo], v[:, lo + h]
        v[:, lo], v[:, lo + h] = a + c, a - c
        h *= 2
    v = v * torch.tensor(1.0 / math.sqrt(b), dtype=torch.float32)
    return v.reshape(x.shape).to(x.dtype)


def scipy_hadamard(x: torch.Tensor, b: int) -> torch.Tensor:
    h = torch.tensor(scipy.linalg.hadamard(b) / math.sqrt(b), dtype=torch.float64)
    return (x.double().reshape(*x.shape[:-1], -1, b) @ h).reshape(x.shape)


def q(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """t fake-quantized in blocks along its last axis, round to nearest (the format's defaults);
    NVFP4's fp32 scale from the whole tensor's amax."""
    return formats.fake_quantize(t.contiguous(), fmt)


def q_tokens(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The forward's activations: NVFP4 takes one fp32 scale per token row (qtransform's dynamic
    activation default), so each row is quantized as a tensor of its own."""
    if fmt != "nvfp4":
        return q(x, fmt)
    rows = x.reshape(-1, x.shape[-1])
    return torch.cat([q(row[None], fmt) for row in rows]).reshape(x.shape)


class ByHand(torch.autograd.Function):
    """One FP-Quant Linear as docs/training.md states it: y = Q(X·R)·Q(W·R)ᵀ + b, and per
    backward_dtype the two backward GEMMs on the rotated operands, their results rotated back
    (R = H_b/√b is symmetric, so rotating back is the same butterfly)."""

    @staticmethod
    def forward(ctx, x, w, bias, fmt: str, b: int, backward: str):  # type: ignore[override]
        xr, wr = by_hand_hadamard(x, b), by_hand_hadamard(w, b)
        xq, wq = q_tokens(xr, fmt), q(wr, fmt)
        ctx.save_for_backward(xr, wr, xq, wq)
        ctx.b, ctx.backward, ctx.has_bias = b, backward, bias is not None
        return F.linear(xq, wq, bias)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        xr, wr, xq, wq = ctx.saved_tensors
        g2, x2 = g.reshape(-1, wr.shape[0]), xr.reshape(-1, wr.shape[1])
        xq2 = xq.reshape(x2.shape)
        if ctx.backward == "bf16":  # FPQuant4x16MasterFn: G·W and Gᵀ·X, unquantized
            dxr, dwr = g2.mm(wr), g2.t().mm(x2)
        elif ctx.backward == "mxfp8":  # G in MXFP8; the forward's MXFP4 W and X re-laid as MXFP8
            dxr = q(g2, "mxfp8_e4m3").mm(q(wq.t(), "mxfp8_e4m3").t())
            dwr = q(g2.t(), "mxfp8_e4m3").mm(q(xq2.t(), "mxfp8_e4m3").t())
        else:  # mxfp4: the forward's W and X requantized after D·H32 (the dense reference
            # matmul), dgrad along out, wgrad along the tokens
            signs = hadamard.random_signs(32, 0)
            h32 = torch.tensor(scipy.linalg.hadamard(32) / math.sqrt(32), dtype=torch.float64).float()

            def rot(t):
                return ((t.reshape(t.shape[0], -1, 32) * signs) @ h32).reshape(t.shape)

            dxr = q(rot(g2), "mxfp4").mm(q(rot(wq.t().contiguous()), "mxfp4").t())
            dwr = q(rot(g2.t()), "mxfp4").mm(q(rot(xq2.t()), "mxfp4").t())
        dx = by_hand_hadamard(dxr, ctx.b).reshape(xr.shape)
        dw = by_hand_hadamard(dwr, ctx.b)
        return dx, dw, g2.sum(0) if ctx.has_bias else None, None, None, None


def preset(fmt: str, **options) -> dict:
    return {"version": 1, "preset": f"fp-quant/{fmt}", "preset_options": options}


def test_by_hand_hadamard_is_scipys_matrix():
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    for b in (16, 32, 64, 128):
        torch.testing.assert_close(by_hand_hadamard(x, b).double(), scipy_hadamard(x, b), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("fmt", "options", "group"), [
    ("mxfp4", {}, 32), ("nvfp4", {}, 16), ("mxfp4", {"hadamard_group_size": 128}, 128),
    ("nvfp4", {"hadamard_group_size": 64}, 64)])
def test_preset_expands_to_a_hadamard_and_a_high_precision_backward(fmt, options, group):
    policy = load_policy(preset(fmt, **options))
    (rot,) = policy.rotate
    assert (rot.kind, rot.block_size, rot.targets, rot.ignore) == ("hadamard", group, ["Linear"], ["re:lm_head"])
    (rule,) = policy.quantize
    assert (rule.format, rule.tensors, rule.backward) == (fmt, ["weight", "input"], "high_precision")
    assert rule.backward_roles is None and rule.wgrad_hadamard is None


def test_mxfp8_and_mxfp4_backwards_expand_to_their_roles():
    mx8 = load_policy(preset("mxfp4", backward_dtype="mxfp8")).quantize[0]
    assert mx8.backward == "quantized" and mx8.wgrad_hadamard is None
    roles = mx8.backward_roles
    assert roles.grad_wgrad == "same" and roles.grad.source == "high_precision"
    assert (roles.grad.format, roles.grad.block_size) == ("mxfp8_e4m3", 32)
    for role in (roles.weight, roles.input):  # the forward's MXFP4 copies, re-laid as MXFP8
        assert (role.format, role.block_size, role.source) == ("mxfp8_e4m3", 32, "forward")
    mx4 = load_policy(preset("mxfp4", backward_dtype="mxfp4")).quantize[0]
    assert {r: getattr(mx4.backward_roles, r).format for r in ("grad", "weight", "input")} == dict.fromkeys(
        ("grad", "weight", "input"), "mxfp4")
    assert (mx4.backward_roles.weight.source, mx4.backward_roles.input.source) == ("forward", "forward")
    for h in (mx4.wgrad_hadamard, mx4.dgrad_hadamard):
        assert (h.kind, h.block_size, h.seed) == ("random_hadamard", 32, 0)
    assert load_policy(preset("mxfp4", backward_dtype="mxfp8")).quantize[0].dgrad_hadamard is None
    assert load_policy(preset("mxfp4", transform_init="identity")).rotate == []


@pytest.mark.parametrize(("fmt", "options"), [
    ("nvfp4", {"backward_dtype": "mxfp4"}),  # FP-Quant: only an MXFP4 forward has a quantized backward
    ("mxfp4", {"hadamard_group_size": 16}),  # MXFP4 takes groups of 32, 64, 128
    ("mxfp4", {"forward_method": "quest"}),  # QuEST's scale is not modelled: not an option
])
def test_combinations_fp_quant_refuses_are_refused_naming_the_option(fmt, options):
    with pytest.raises(PolicyError, match=f"preset_options.{next(iter(options))}"):
        load_policy(preset(fmt, **options))


def linear_data(seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=gen) * torch.logspace(-1, 1, IN)
    w = torch.randn(OUT, IN, generator=gen) * 0.05
    g = torch.randn(TOKENS, OUT, generator=gen) * 1e-2
    return x, w, torch.randn(OUT, generator=gen), g


@pytest.mark.parametrize(("fmt", "options"), [
    ("mxfp4", {}), ("mxfp4", {"hadamard_group_size": 64}), ("mxfp4", {"hadamard_group_size": 128}),
    ("nvfp4", {}), ("nvfp4", {"hadamard_group_size": 32}),
    ("mxfp4", {"backward_dtype": "mxfp8"}), ("mxfp4", {"backward_dtype": "mxfp4"}),
    ("mxfp4", {"backward_dtype": "mxfp4", "hadamard_group_size": 64}),
])
def test_preset_on_a_linear_is_the_by_hand_implementation_bit_for_bit(fmt, options):
    x, w, bias, g = linear_data(0)
    lin = nn.Linear(IN, OUT)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(bias)
    model = qtransform.transform(nn.Sequential(copy.deepcopy(lin)), preset(fmt, **options))
    xl = x.clone().requires_grad_(True)
    y = model(xl)
    y.backward(g)
    group = options.get("hadamard_group_size", 32 if fmt == "mxfp4" else 16)
    xh, wh, bh = x.clone().requires_grad_(True), w.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    want = ByHand.apply(xh, wh, bh, fmt, group, options.get("backward_dtype", "bf16"))
    want.backward(g)
    assert torch.equal(y, want)
    assert torch.equal(xl.grad, xh.grad)
    assert torch.equal(model[0].weight.grad, wh.grad)
    assert torch.equal(model[0].bias.grad, bh.grad)
    # the rotation and the backward matter: without the Hadamard the forward differs, and the
    # straight-through backward gives other gradients
    assert not torch.equal(y, F.linear(q_tokens(x, fmt), q(w, fmt), bias))
    assert not torch.equal(xl.grad, g.mm(by_hand_hadamard(q(by_hand_hadamard(w, group), fmt), group)))


def by_hand_model(model: nn.Module, fmt: str, group: int, backward: str) -> nn.Module:
    """A copy of `model` whose Linears but lm_head run ByHand."""
    twin = copy.deepcopy(model)
    for name, mod in twin.named_modules():
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            mod.forward = (lambda m: lambda x: ByHand.apply(x, m.weight, m.bias, fmt, group, backward))(mod)
    return twin


@pytest.mark.parametrize(("fmt", "options"), [
    ("mxfp4", {}), ("nvfp4", {}), ("mxfp4", {"backward_dtype": "mxfp8", "hadamard_group_size": 64}),
    ("mxfp4", {"backward_dtype": "mxfp4"}),
])
def test_preset_on_a_tiny_qwen2_is_the_by_hand_implementation_bit_for_bit(fmt, options):
    model = build_tiny("qwen2", num_layers=1)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    got = qtransform.transform(model, preset(fmt, **options)).train()
    group = options.get("hadamard_group_size", 32 if fmt == "mxfp4" else 16)
    want = by_hand_model(model, fmt, group, options.get("backward_dtype", "bf16")).train()
    out_got, out_want = got(input_ids=ids).logits, want(input_ids=ids).logits
    assert torch.equal(out_got, out_want)
    r = torch.randn(out_got.shape, generator=torch.Generator().manual_seed(4))
    (out_got * r).sum().backward()
    (out_want * r).sum().backward()
    grads_got = {n: p.grad for n, p in got.named_parameters() if p.grad is not None}
    grads_want = {n: p.grad for n, p in want.named_parameters() if p.grad is not None}
    assert grads_got.keys() == grads_want.keys() and len(grads_got) > 10
    for name, grad in grads_want.items():
        assert torch.equal(grads_got[name], grad), name


def test_role_source_forward_requantizes_the_forwards_copy_and_is_refused_for_the_gradient():
    """`source: "forward"` (the role field the mxfp8/mxfp4 backwards use): the input role
    quantizes the forward's NVFP4 X along the tokens, not X itself."""
    x, w, _, g = linear_data(1)

    def grads(source: str) -> tuple[torch.Tensor, torch.Tensor]:
        roles = {"grad": {"format": "mxfp8_e4m3"}, "input": {"format": "mxfp8_e4m3", "source": source}}
        rule = {"name": "r", "targets": ["Linear"], "format": "nvfp4", "tensors": ["weight", "input"],
                "backward": "quantized", "backward_roles": roles}
        model = qtransform.transform(nn.Sequential(nn.Linear(IN, OUT, bias=False)), {"version": 1, "quantize": [rule]})
        with torch.no_grad():
            model[0].weight.copy_(w)
        model(x).backward(g)
        return model[0].weight.grad, q_tokens(x, "nvfp4")

    dw, xq = grads("forward")
    assert torch.equal(dw, q(g.t(), "mxfp8_e4m3").mm(q(xq.t(), "mxfp8_e4m3").t()))
    assert not torch.equal(grads("high_precision")[0], dw)
    bad = {"name": "r", "targets": ["Linear"], "format": "nvfp4", "tensors": ["weight", "input"],
           "backward": "quantized", "backward_roles": {"grad": {"format": "nvfp4", "source": "forward"}}}
    with pytest.raises(PolicyError, match="backward_roles.grad.source"):
        load_policy({"version": 1, "quantize": [bad]})


def test_dgrad_hadamard_needs_the_quantized_backward_and_a_block_dividing_the_outputs():
    rule = {"name": "r", "targets": ["Linear"], "format": "mxfp4", "tensors": ["weight", "input"],
            "backward": "high_precision", "dgrad_hadamard": {"block_size": 32}}
    with pytest.raises(PolicyError, match="dgrad_hadamard"):
        load_policy({"version": 1, "quantize": [rule]})
    rule["backward"] = "quantized"
    with pytest.raises(qtransform.UserError, match="block of 32 does not divide its 48 output features"):
        qtransform.transform(nn.Sequential(nn.Linear(IN, 48)), {"version": 1, "quantize": [rule]})


@pytest.mark.parametrize("backward_dtype", ["mxfp8", "mxfp4"])
def test_graph_mode_gives_the_module_modes_gradients(backward_dtype):
    x, w, bias, g = linear_data(2)
    lin = nn.Sequential(nn.Linear(IN, OUT))
    with torch.no_grad():
        lin[0].weight.copy_(w)
        lin[0].bias.copy_(bias)
    got = []
    for mode in ("module", "graph"):
        model = qtransform.transform(lin, preset("mxfp4", backward_dtype=backward_dtype), x, mode=mode)
        xl = x.clone().requires_grad_(True)
        y = model(xl)
        y.backward(g)
        got.append((y, xl.grad, dict(model.named_parameters())["0.weight"].grad))
    for a, b in zip(*got, strict=True):
        assert torch.equal(a, b)
