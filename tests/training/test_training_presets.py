"""The training presets against their stacks: torchao's emulated MXFP8 training itself (bit for bit,
forward output and both gradients) and the independent references of tests/training_reference.py
(Transformer Engine's NVFP4BlockScaling with each switch, MXFP8BlockScaling)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qtransform
from qtransform.core.backward import BackwardLinear
from qtransform.core.streams import DrawStream
from qtransform.formats import philox
from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas.explain import explain
from tests import training_reference as ref

TE_NVFP4 = "transformer-engine/NVFP4BlockScaling"
TE_MXFP8 = "transformer-engine/MXFP8BlockScaling"
TOKENS, IN, OUT = 64, 96, 128


def operands(seed: int, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, IN, generator=gen) * torch.logspace(-1.5, 1.5, IN)
    w = torch.randn(OUT, IN, generator=gen) * 0.05
    g = torch.randn(TOKENS, OUT, generator=gen) * torch.logspace(-4, -2, OUT)
    return x.to(dtype), w.to(dtype), g.to(dtype)


def run(policy: dict, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> ref.Grads:
    """y, dX, dW of one bias-free Linear (weight w) transformed by `policy`, with dL/dy = g."""
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False)).to(x.dtype)
    with torch.no_grad():
        model[0].weight.copy_(w)
    model = qtransform.transform(model, {"version": 1, **policy})
    xl = x.detach().clone().requires_grad_(True)
    y = model(xl)
    y.backward(g)
    return ref.Grads(y.detach(), xl.grad, model[0].weight.grad)


@pytest.mark.parametrize("wgrad_with_hp", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_preset_is_torchao_emulated_mxfp8_bit_for_bit(seed, dtype, wgrad_with_hp):
    x, w, g = operands(seed, dtype)
    name = "torchao/MXFP8_RCEIL_WGRAD_WITH_HP" if wgrad_with_hp else "torchao/MXFP8_RCEIL"
    ours = run({"preset": name}, x, w, g)
    theirs = ref.torchao_emulated_mxfp8(x, w, g, wgrad_with_hp)
    assert torch.equal(ours.y, theirs.y)
    assert torch.equal(ours.dx, theirs.dx)
    assert torch.equal(ours.dw, theirs.dw)
    # not the straight-through backward: the quantized gradients are what is compared
    plain = run({"quantize": [{"name": "fwd", "targets": ["Linear"], "format": "mxfp8_e4m3",
                               "tensors": ["weight", "input"], "scale_rule": "rceil"}]}, x, w, g)
    assert torch.equal(plain.y, theirs.y) and not torch.equal(plain.dx, theirs.dx)


def test_te_mxfp8_preset_is_the_reference_and_hybrid_uses_e5m2_gradients():
    x, w, g = operands(2)
    ours = run({"preset": TE_MXFP8}, x, w, g)
    want = ref.torchao_mxfp8_linear(x, w, g)  # TE's MXFP8 copies are torchao's, RCEIL included
    assert torch.equal(ours.y, want.y) and torch.equal(ours.dx, want.dx) and torch.equal(ours.dw, want.dw)
    hybrid = run({"preset": TE_MXFP8, "preset_options": {"fp8_format": "HYBRID"}}, x, w, g)
    assert torch.equal(hybrid.y, want.y) and not torch.equal(hybrid.dx, want.dx)
    policy = load_policy({"preset": TE_MXFP8, "preset_options": {"fp8_format": "HYBRID"}})
    assert policy.quantize[0].backward_roles.grad.format == "mxfp8_e5m2"


def te_switches(options: dict) -> ref.TESwitches:
    return ref.TESwitches(**{k: v for k, v in options.items() if k != "row_scaled_activation"})


@pytest.mark.parametrize("options", [
    {"disable_rht": True, "disable_stochastic_rounding": True},
    {"disable_rht": True, "disable_stochastic_rounding": True, "disable_2d_quantization": True},
    {"backward_override": "high_precision"},
    {"backward_override": "dequantized"},
    {"backward_override": "dequantized", "disable_2d_quantization": True},
])
def test_te_nvfp4_round_to_nearest_modes_equal_the_reference(options):
    """Every mode without stochastic draws or random signs: forward and both gradients equal TE's
    reference (16x16 weight tiles, 1x16 blocks, one fp32 scale per tensor copy) exactly."""
    x, w, g = operands(3)
    ours = run({"preset": TE_NVFP4, "preset_options": options}, x, w, g)
    want = ref.te_nvfp4_linear(x, w, g, te_switches(options))
    assert torch.equal(ours.y, want.y)
    assert torch.equal(ours.dx, want.dx)
    assert torch.equal(ours.dw, want.dw)


def test_te_nvfp4_rht_is_te_s_own_transform():
    """The preset's Hadamard takes TE's fixed sign vector, so with the Hadamard on (no stochastic
    rounding) forward, dgrad and wgrad equal TE's reference exactly."""
    policy = load_policy({"preset": TE_NVFP4})
    assert tuple(policy.quantize[0].wgrad_hadamard.signs) == ref.TE_RHT_SIGNS
    x, w, g = operands(4)
    ours = run({"preset": TE_NVFP4, "preset_options": {"disable_stochastic_rounding": True}}, x, w, g)
    want = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(disable_stochastic_rounding=True))
    assert torch.equal(ours.y, want.y) and torch.equal(ours.dx, want.dx)
    assert torch.equal(ours.dw, want.dw)
    assert not torch.equal(ours.dw, run({"preset": TE_NVFP4, "preset_options": {
        "disable_stochastic_rounding": True, "disable_rht": True}}, x, w, g).dw)


@pytest.mark.parametrize("disable_rht", [False, True])
def test_te_nvfp4_stochastic_gradients_are_the_reference_with_the_stream_draws(disable_rht):
    """The full recipe (and without its Hadamard): G's two copies rounded stochastically with the
    draws of the documented Philox streams (one per operand of the site), everything else as TE's
    reference: forward, dgrad and wgrad bit for bit."""
    x, w, g = operands(5)
    policy = {"preset": TE_NVFP4, "preset_options": {"disable_rht": disable_rht}}
    model = nn.Sequential(nn.Linear(IN, OUT, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    model = qtransform.transform(model, {"version": 1, **policy})
    (site,) = [m for m in model.modules() if isinstance(m, BackwardLinear)]
    xl = x.clone().requires_grad_(True)
    y = model(xl)
    y.backward(g)
    def draws(op: str, shape: tuple[int, int]) -> torch.Tensor:  # call 0 of step 0 of the operand's stream
        return philox.uniform_at(DrawStream(0, f"{site.label}/{op}").seed_at(0), philox.positions(shape))

    u_d, u_w = draws("grad_dgrad", (TOKENS, OUT)), draws("grad_wgrad", (OUT, TOKENS))
    want = ref.te_nvfp4_linear(x, w, g, ref.TESwitches(disable_rht=disable_rht), u_d, u_w)
    assert torch.equal(y.detach(), want.y)
    assert torch.equal(xl.grad, want.dx)
    assert torch.equal(model[0].weight.grad, want.dw)


def test_te_nvfp4_stochastic_rounding_is_unbiased_and_reproducible():
    """Averaged over backward calls, the stochastically rounded wgrad approaches Gᵀ·Q(X) (the exact
    G against X's round-to-nearest copy) where round-to-nearest G stays biased; the same seed and
    step give the same gradient."""
    x, w, g = operands(6)

    def grads(options, steps):
        model = nn.Sequential(nn.Linear(IN, OUT, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(w)
        model = qtransform.transform(model, {"version": 1, "preset": TE_NVFP4, "preset_options": options})
        out = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(x).backward(g)
            out.append(model[0].weight.grad.clone())
        return out

    exact = g.T @ ref.nvfp4(x.T.contiguous()).T
    sr = grads({"disable_rht": True}, 48)
    rn = grads({"disable_rht": True, "disable_stochastic_rounding": True}, 1)[0]
    assert (torch.stack(sr).mean(0) - exact).norm() < 0.5 * (rn - exact).norm()
    assert not torch.equal(sr[0], sr[1])  # new draws every backward call
    again = grads({"disable_rht": True}, 2)
    assert torch.equal(again[0], sr[0]) and torch.equal(again[1], sr[1])


def test_te_nvfp4_preset_expands_to_te_rules_and_explains_its_options():
    policy = load_policy({"preset": TE_NVFP4, "preset_options": {"disable_rht": True}})
    weights, inputs = policy.quantize
    assert weights.block_shape == (16, 16) and inputs.global_scale == "tensor"
    assert weights.backward_roles.weight == "forward"
    assert weights.backward_roles.grad.rounding == "stochastic"
    assert weights.wgrad_hadamard is None and inputs.wgrad_hadamard is None
    assert "Options: disable_rht=true." in explain(policy)
    assert load_policy(policy.to_json()) == policy
    default = load_policy({"preset": TE_NVFP4})
    assert default.quantize[0].wgrad_hadamard.block_size == 16
    row = load_policy({"preset": TE_NVFP4, "preset_options": {"row_scaled_activation": True}})
    assert row.quantize[1].global_scale == "token"


def test_te_nvfp4_bad_option_is_one_line_naming_the_switches():
    with pytest.raises(PolicyError) as info:
        load_policy({"preset": TE_NVFP4, "preset_options": {"disable_hadamard": True}})
    text = str(info.value)
    assert "\n" not in text and "preset_options.disable_hadamard: not an option of preset" in text
    assert "disable_rht" in text and "disable_2d_quantization" in text


def test_every_combination_of_te_options_validates_and_round_trips():
    from itertools import product

    from qtransform.schemas.loading import dump_policy
    from qtransform.schemas.presets import find_preset

    for name in (TE_NVFP4, TE_MXFP8):  # the four-over-six switches: the test below
        options = [o for o in find_preset(name).options if not o.name.startswith("nvfp4_4over6")]
        for values in product(*[(False, True) if o.choices is None else o.choices for o in options]):
            given = dict(zip([o.name for o in options], values, strict=True))
            policy = load_policy({"preset": name, "preset_options": given})
            assert {k: policy.preset_options[k] for k in given} == given
            assert load_policy(dump_policy(policy)) == policy
            expected = given["backward_override"] or "quantized"
            assert {r.backward for r in policy.quantize} == {expected}


def test_te_four_over_six_switches_set_the_nvfp4_options_per_scope():
    """NVTE_NVFP4_4OVER6 scopes (never gradients), the 256 bound by scope, MAE by default; the
    combinations TE or qtransform refuse are one-line errors."""
    from itertools import product

    base = {"disable_rht": True, "disable_2d_quantization": True}
    for scope, use256, mode in product(("none", "weights", "activations", "all"),
                                       ("none", "weights", "activations", "all"), ("MAE", "MSE")):
        opts = base | {"nvfp4_4over6": scope, "nvfp4_4over6_e4m3_use_256": use256,
                       "nvfp4_4over6_err_mode": mode}
        weights, inputs = load_policy({"preset": TE_NVFP4, "preset_options": opts}).quantize
        for rule, part in ((weights, "weights"), (inputs, "activations")):
            on = scope in (part, "all")
            cfg = rule.config()
            assert cfg.four_over_six == (mode.lower() if on else "none")
            assert cfg.global_bound == ("256" if on and use256 in (part, "all") else "448")
            assert cfg.four_over_six_order == ("transformer-engine" if on else "pairwise")
            role = rule.backward_roles.weight if part == "weights" else rule.backward_roles.input
            assert role.config().four_over_six == cfg.four_over_six  # the columnwise copy too
            assert rule.backward_roles.grad.config().four_over_six == "none"
    with pytest.raises(PolicyError, match="set disable_2d_quantization true"):
        load_policy({"preset": TE_NVFP4, "preset_options": {"nvfp4_4over6": "weights"}})
    with pytest.raises(PolicyError, match="set disable_rht true"):
        load_policy({"preset": TE_NVFP4, "preset_options": {"nvfp4_4over6": "activations"}})
