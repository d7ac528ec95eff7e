"""The rotate pass against an independent implementation.

The reference is written here without qtransform's rotation code: R is built densely in float64
(scipy's Sylvester Hadamard matrix, divided by sqrt(b), the signs from the documented stream)
and applied by hand to real transformers models: a forward pre-hook turns each selected Linear's
input into x·R and its weight is replaced by W·R. Fake quantization in the reference is the
float64 MXFP4 of tests/helpers.py. In full precision the rotated model must equal the original
up to fp32 rounding; quantized, ours must equal the hand-rotated, hand-quantized model apart
from rounding-boundary ties.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import qtransform
from qtransform.errors import UserError
from qtransform.formats import philox
from qtransform.models import build_tiny
from qtransform.passes import FakeQuantize, Rotate
from tests.helpers import mxfp4_f64

IDS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))


def dense_rotation(b: int, kind: str = "hadamard", seed: int = 0) -> torch.Tensor:
    """R = diag(s)·H_b/sqrt(b) in float64, H from scipy, s from the documented draw rule."""
    h = torch.from_numpy(scipy.linalg.hadamard(b).astype(np.float64)) / np.sqrt(b)
    if kind == "random_hadamard":
        u = philox.uniform_at(seed, torch.arange(b, dtype=torch.int64))
        s = torch.where(u < 0.5, 1.0, -1.0).to(torch.float64)
        h = s[:, None] * h
    return h


def block_diag(r: torch.Tensor, n: int) -> torch.Tensor:
    return torch.block_diag(*[r] * (n // r.shape[0]))


def rotated_by_hand(model, r_of, names, quantize: bool = False):
    """A copy of `model` whose Linears in `names` compute with x·R and W·R (float64 products,
    rounded to fp32 once), MXFP4-quantized in float64 when `quantize`."""
    ref = copy.deepcopy(model)
    for name in names:
        lin = ref.get_submodule(name)
        n = lin.in_features
        big = block_diag(r_of(n), n)
        w = lin.weight.detach().double() @ big
        w = w.float()
        if quantize:
            w = mxfp4_f64(w)[0]
        lin.weight = torch.nn.Parameter(w)

        def hook(mod, args, big=big):
            x = (args[0].double() @ big).float()
            return (mxfp4_f64(x)[0] if quantize else x,)

        lin.register_forward_pre_hook(hook)
    return ref


def linear_names(model, skip=("lm_head",)):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
            and not n.endswith(skip) and not n.endswith((".mlp.gate", "shared_expert_gate"))]


def rotate_policy(kind="hadamard", block=32, quantize=False, **extra):
    pol = {"version": 1, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "kind": kind,
                                     "block_size": block, **extra}]}
    if quantize:
        pol["quantize"] = [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4",
                            "tensors": ["weight", "input"]}]
    return pol


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_moe"])
@pytest.mark.parametrize("kind", ["hadamard", "random_hadamard"])
def test_full_precision_outputs_equal_the_original_and_the_hand_rotated_model(arch, kind):
    model = build_tiny(arch)
    r_of = lambda n: dense_rotation(32, kind, 7)  # noqa: E731
    out = logits(qtransform.transform(model, rotate_policy(kind, 32, seed=7) if kind != "hadamard"
                                      else rotate_policy(kind, 32)))
    want = logits(model)
    by_hand = logits(rotated_by_hand(model, r_of, linear_names(model)))
    scale = want.abs().max()
    assert (out - want).abs().max() <= 2e-6 * scale
    assert (out - by_hand).abs().max() <= 2e-6 * scale
    assert not torch.equal(out, want)  # the rotation really ran (rounding moved)


def test_every_linear_of_a_moe_model_is_rotated_experts_included_and_routers_passed_by():
    model = build_tiny("qwen2_moe")
    program = qtransform.transform_program(model, rotate_policy("hadamard", 64))
    sites = {(r.site, r.point) for r in program.plan_rows if r.pass_name == "rotate"}
    assert ("model.layers.0.mlp.experts.gate_up_proj", "weight") in sites
    assert ("model.layers.0.mlp.experts.down_proj", "input") in sites
    assert not any(s.endswith(("mlp.gate", "shared_expert_gate")) for s, _ in sites)
    out = logits(program.model)
    want = logits(model)
    assert (out - want).abs().max() <= 2e-6 * want.abs().max()
    experts = program.model.model.layers[0].mlp.experts
    rot = experts.gate_up_proj__weight_rotate
    r = dense_rotation(64)
    want_w = (experts.gate_up_proj.detach().double() @ r).float()
    torch.testing.assert_close(rot(experts.gate_up_proj), want_w, rtol=0, atol=2e-6)


def test_conv1d_weights_stored_in_out_are_rotated_along_their_first_axis():
    model = build_tiny("gpt2")
    out = logits(qtransform.transform(model, {"version": 1, "rotate": [{"targets": ["Conv1D"], "block_size": 16}]}))
    want = logits(model)
    assert (out - want).abs().max() <= 2e-6 * want.abs().max()
    site = qtransform.transform(model, {"version": 1, "rotate": [{"targets": ["h.0.mlp.c_fc"], "block_size": 16}]})
    conv = site.transformer.h[0].mlp.c_fc
    want_w = (block_diag(dense_rotation(16), 64).T @ conv.weight.detach().double()).float()
    torch.testing.assert_close(conv.weight_rotate(conv.weight), want_w, rtol=0, atol=2e-6)


def _boundary_ties(ours: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Where quantizing the exact rotated value and ours (equal to fp32 rounding) differ."""
    return mxfp4_f64(ours)[0] != mxfp4_f64(exact)[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_mxfp4_w4a4_equals_hand_rotation_then_float64_mxfp4_apart_from_ties(arch):
    model = build_tiny(arch)
    ours = qtransform.transform(model, rotate_policy("random_hadamard", 32, quantize=True, seed=2))
    r = dense_rotation(32, "random_hadamard", 2)
    # weights: the quantizer's output is exactly MXFP4 of our rotated weight, and that differs
    # from MXFP4 of the exact product only where the two round across a boundary
    ties = total = 0
    for name in linear_names(model):
        site = ours.get_submodule(name)
        rotated = site.weight_rotate(site.weight).detach()
        exact = site.weight.detach().double() @ block_diag(r, site.in_features)
        assert (rotated.double() - exact).abs().max() <= 2e-6 * exact.abs().max()
        quant = site.weight_fake_quant(rotated)
        assert torch.equal(quant, mxfp4_f64(rotated)[0])
        want = mxfp4_f64(exact.float())[0]
        differ = quant != want
        assert torch.equal(differ, differ & _boundary_ties(rotated, exact.float()))
        ties += int(differ.sum())
        total += quant.numel()
    assert ties <= 0.002 * total
    # end to end: the hand-rotated, hand-quantized model gives the same next-token choices and
    # logits within the few quantization steps that ties move
    by_hand = logits(rotated_by_hand(model, lambda n: r, linear_names(model), quantize=True))
    out = logits(ours)
    assert torch.equal(out.argmax(-1), by_hand.argmax(-1))
    kl = F.kl_div(F.log_softmax(out, -1), F.log_softmax(by_hand, -1), log_target=True, reduction="batchmean")
    assert float(kl) < 1e-3


def test_the_rotated_weight_is_computed_once_per_weight_version():
    model = qtransform.transform(build_tiny("qwen2"), rotate_policy("hadamard", 64, quantize=True))
    site = model.model.layers[0].mlp.down_proj
    rot = site.weight_rotate
    logits(model)
    first = rot._cached
    logits(model)
    assert rot._cached is first  # unchanged weight: the same tensor, the fake-quant cache holds
    with torch.no_grad():
        site.weight[0, 0] += 1.0
    logits(model)
    assert rot._cached is not first
    want = (site.weight.detach().double() @ block_diag(dense_rotation(64), 128)).float()
    torch.testing.assert_close(rot._cached, want, rtol=0, atol=2e-6)


def test_gradients_reach_the_original_weight_through_the_rotation():
    model = build_tiny("qwen2")
    ours = qtransform.transform(model, rotate_policy("random_hadamard", 32, seed=1), inplace=False)
    ref = copy.deepcopy(model)
    for m in (ours, ref):
        m.train()
        m(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    got = ours.model.layers[1].self_attn.q_proj.weight.grad
    want = ref.model.layers[1].self_attn.q_proj.weight.grad
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_learned_matrix_from_safetensors_or_pt_rotates_exactly(tmp_path):
    model = build_tiny("qwen2")
    q, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    save_file({"R": q.float().contiguous()}, tmp_path / "r.safetensors")
    torch.save(q.float(), tmp_path / "r.pt")
    want = logits(model)
    for file in ("r.safetensors", "r.pt"):
        pol = {"version": 1, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "kind": "matrix",
                                         "matrix": str(tmp_path / file)}]}
        out = logits(qtransform.transform(model, pol))
        assert (out - want).abs().max() <= 2e-6 * want.abs().max()
    by_hand = logits(rotated_by_hand(model, lambda n: q, linear_names(model)))
    assert (out - by_hand).abs().max() <= 2e-6 * want.abs().max()


def _error(model, rule) -> str:
    with pytest.raises(UserError) as err:
        qtransform.transform(model, {"version": 1, "rotate": [rule]})
    return str(err.value)


def test_bad_rotations_are_user_errors_that_name_the_field_and_the_fix(tmp_path):
    model = build_tiny("qwen2")
    msg = _error(model, {"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 256})
    assert "rotate[0].block_size" in msg and "does not divide the 64 input features" in msg
    assert "2, 4, 8, 16, 32, 64" in msg
    msg = _error(model, {"targets": ["Linear"], "block_size": 24})
    assert "rotate[0].block_size" in msg and "power of two" in msg and "16 or 32" in msg
    save_file({"R": torch.randn(64, 64)}, tmp_path / "bad.safetensors")
    msg = _error(model, {"targets": ["Linear"], "kind": "matrix", "matrix": str(tmp_path / "bad.safetensors")})
    assert "rotate[0].matrix" in msg and "not orthogonal" in msg
    save_file({"a": torch.eye(64), "b": torch.eye(64)}, tmp_path / "two.safetensors")
    assert "holds 2 tensors" in _error(model, {"targets": ["Linear"], "kind": "matrix",
                                               "matrix": str(tmp_path / "two.safetensors")})
    assert "no file" in _error(model, {"targets": ["Linear"], "kind": "matrix", "matrix": "missing.pt"})
    msg = _error(model, {"targets": ["Linear"], "kind": "matrix"})
    assert "rotate[0].matrix" in msg and "needs the path" in msg
    assert "rotate[0].seed" in _error(model, {"targets": ["Linear"], "seed": 3})


def test_a_whole_axis_that_is_not_a_power_of_two_needs_a_block_size():
    model = build_tiny("qwen2", hidden=96)
    msg = _error(model, {"targets": ["Linear"], "ignore": ["lm_head"]})
    assert "null means the whole axis" in msg and "96 input features" in msg and "32" in msg


def test_a_later_rule_overrides_an_earlier_one_and_turning_it_off_restores_the_model():
    model = build_tiny("qwen2")
    pol = {"version": 1, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 16},
                                    {"name": "wide", "targets": ["mlp.down_proj"], "block_size": 128}]}
    program = qtransform.transform_program(model, pol)
    rows = {(r.site, r.point): r for r in program.plan_rows}
    assert rows[("model.layers.0.mlp.down_proj", "input")].rule == "rotate[1] 'wide'"
    assert rows[("model.layers.0.mlp.down_proj", "input")].detail == "hadamard block=128"
    assert rows[("model.layers.0.mlp.up_proj", "weight")].detail == "hadamard block=16"
    for m in program.model.modules():
        if isinstance(m, Rotate):
            m.enabled = False
    assert torch.equal(logits(program.model), logits(model))


def test_taps_measure_the_quantization_error_of_the_rotated_tensors():
    model = build_tiny("qwen2")
    pol = rotate_policy("hadamard", 32, quantize=True)
    pol["instrument"] = {"points": ["weight", "input", "output"]}
    program = qtransform.transform_program(model, pol)
    logits(program.model)
    site = program.model.model.layers[0].mlp.up_proj
    rotated = site.weight_rotate(site.weight).detach()
    quant = site.weight_fake_quant(rotated)
    tap = next(m for m in site.modules() if type(m).__name__ == "Tap" and m.point == "weight")
    err = (rotated.double() - quant.double())
    want_sqnr = 10 * np.log10(float((rotated.double() ** 2).sum()) / float((err ** 2).sum()))
    assert tap.result()["quant"]["sqnr_db"] == pytest.approx(want_sqnr, rel=1e-9)


def test_fake_quant_follows_the_rotation_in_every_site_graph():
    program = qtransform.transform_program(build_tiny("llama"), rotate_policy("hadamard", 32, quantize=True))
    site = program.model.model.layers[0].self_attn.o_proj
    order = [(i.point, i.pass_name) for i in program.insertions(site="model.layers.0.self_attn.o_proj")]
    assert order == [("weight", "rotate"), ("input", "rotate"), ("weight", "fake_quant"), ("input", "fake_quant")]
    assert isinstance(site.weight_fake_quant, FakeQuantize)


def test_the_whole_model_graph_rotates_as_the_module_graphs_do():
    model = build_tiny("qwen2")
    pol = rotate_policy("random_hadamard", 32, quantize=True, seed=4)
    graph = qtransform.transform(model, pol, example_inputs={"input_ids": IDS}, mode="graph")
    with torch.no_grad():
        assert torch.equal(graph(input_ids=IDS, use_cache=False).logits, logits(qtransform.transform(model, pol)))
    with pytest.raises(UserError, match="fused experts parameter"):
        qtransform.transform(build_tiny("qwen2_moe"), rotate_policy(), example_inputs={"input_ids": IDS}, mode="graph")


def test_moe_expert_weights_quantize_as_hand_rotation_then_float64_mxfp4_apart_from_ties():
    model = build_tiny("qwen2_moe")
    ours = qtransform.transform(model, rotate_policy("hadamard", 64, quantize=True))
    r = dense_rotation(64)
    experts = ours.model.layers[1].mlp.experts
    for param in ("gate_up_proj", "down_proj"):
        w = getattr(experts, param)
        rotated = getattr(experts, f"{param}__weight_rotate")(w).detach()
        exact = (w.detach().double() @ block_diag(r, w.shape[-1])).float()
        assert (rotated - exact).abs().max() <= 2e-6 * exact.abs().max()
        quant = getattr(experts, f"{param}__weight_fake_quant")(rotated)
        assert torch.equal(quant, mxfp4_f64(rotated)[0])  # each expert's matrix along its rows
        differ = quant != mxfp4_f64(exact)[0]
        assert torch.equal(differ, differ & _boundary_ties(rotated, exact))
        assert int(differ.sum()) <= 0.002 * quant.numel()
    out, want = logits(ours), logits(model)
    kl = F.kl_div(F.log_softmax(out, -1), F.log_softmax(want, -1), log_target=True, reduction="batchmean")
    assert 0 < float(kl) < 0.5  # quantized, and still the model
