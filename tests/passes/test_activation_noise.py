"""Activation noise (dropout and multiplicative Gaussian): the noise contract's example pass.

Statistics of the drawn noise against the spec with fixed seeds, reproducibility, bit-identical
outputs when off, the controller (step, disable, state) and phases, the ONNX form bit for bit
against PyTorch with the same draws, and the plan and explain rows.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from torch import nn

import qtransform
from qtransform.core.noise_kinds import noise_kind
from qtransform.core.streams import site_seed
from qtransform.passes.activation_noise import ActivationNoise
from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas.explain import explain
from tests.conftest import ids


def linear(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256))


def policy(**section) -> dict:
    return {"version": 1, "activation_noise": {"p": 0.25, **section}}


def module_of(model: nn.Module) -> ActivationNoise:
    found = [m for m in model.modules() if isinstance(m, ActivationNoise)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_a_fraction_p_and_scales_the_rest_by_one_over_one_minus_p(p):
    model = linear()
    out = qtransform.transform(model, policy(p=p))
    x = torch.randn(256, 64)
    with torch.no_grad():
        clean, noisy = model(x), out(x)
    dropped = noisy == 0
    n = dropped.numel()
    assert abs(dropped.float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    keep = float(np.float32(1.0 / (1.0 - p)))
    assert torch.equal(noisy[~dropped], clean[~dropped] * keep)  # exactly x / (1 - p) in fp32
    # the draws are the documented stream: U[0, 1) from the (seed, label, step, index) generator
    gen = torch.Generator().manual_seed(site_seed(0, "0/output_activation_noise", 0, 0))
    z = torch.rand(clean.shape, generator=gen)
    assert torch.equal(dropped, z < np.float32(p))


def test_gaussian_is_relative_with_the_spec_sigma():
    model = linear()
    out = qtransform.transform(model, policy(distribution="gaussian", p=None, sigma=0.05))
    x = torch.randn(256, 64)
    with torch.no_grad():
        clean = model(x)
        draws = torch.stack([out(x) for _ in range(4)])
    z = (draws / clean - 1) / 0.05
    assert z.std().item() == pytest.approx(1.0, rel=0.02)
    assert abs(z.mean().item()) < 0.02
    assert not torch.equal(draws[0], draws[1])  # fresh every forward
    assert module_of(out).kind == "relative"  # the built-in kind, reused


def test_draws_reproduce_with_the_seed_and_differ_across_seeds_and_forwards():
    x = torch.randn(32, 64)
    runs = []
    for seed in (0, 0, 1):
        out = qtransform.transform(linear(), policy(seed=seed))
        with torch.no_grad():
            runs.append(torch.stack([out(x), out(x)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0][0], runs[0][1])


def test_off_is_bit_identical_eval_disabled_and_p_zero():
    model = linear()
    x = torch.randn(32, 64)
    with torch.no_grad():
        clean = model(x)
        out = qtransform.transform(model, policy())
        assert not torch.equal(out(x), clean)
        with qtransform.noise_controller(out).disabled():
            assert torch.equal(out(x), clean)
        assert not torch.equal(out(x), clean)  # switched back on
        assert torch.equal(out.eval()(x), clean)  # apply_during "train", model in eval
        assert torch.equal(qtransform.transform(model, policy(p=0.0))(x), clean)


def test_gradients_flow_through_kept_elements_only():
    out = qtransform.transform(linear(), policy(point="input"))
    x = torch.randn(8, 64, requires_grad=True)
    out(x).sum().backward()
    kept = x.grad != 0
    assert 0.6 < kept.float().mean().item() < 0.9
    w_sum = out[0].weight.sum(0).expand_as(x)
    assert torch.allclose(x.grad[kept], (w_sum * np.float32(1 / 0.75))[kept], rtol=1e-5, atol=1e-6)


def test_the_controller_steps_switches_and_resumes_it():
    out = qtransform.transform(linear(), policy())
    controller = qtransform.noise_controller(out)
    assert controller.noise == [module_of(out)] and controller.modules == {}
    x = torch.randn(16, 64)
    with torch.no_grad():
        first = out(x)
        controller.step()
        assert controller.current_step == 1
        second = out(x)
        state = controller.state_dict()
        third = out(x)
        controller.load_state_dict(state)  # back to draw 1 of step 1
        assert torch.equal(out(x), third)
        controller.set_step(0)
        assert torch.equal(out(x), first)
    assert not torch.equal(first, second)
    assert state == {"step": 1, "seed": None, "draws": {"0/output_activation_noise": 1},
                     "stream_version": 2}
    assert controller.report()["passes"] == {"activation_noise": {
        "modules": 1, "forwards": 5, "noised_forwards": 5, "syncs": 0, "noised_syncs": 0}}


@pytest.mark.parametrize("phase", ["train", "eval", "both", "rollout"])
def test_apply_during(phase):
    model = linear()
    out = qtransform.transform(model, policy(apply_during=phase))
    x = torch.randn(8, 64)
    with torch.no_grad():
        noisy = {mode: not torch.equal(out.train(mode)(x), model(x)) for mode in (True, False)}
        with qtransform.rollout():
            in_rollout = not torch.equal(out(x), model(x))
    if phase == "rollout":
        assert noisy == {True: False, False: False} and in_rollout
    else:
        assert noisy == {True: phase != "eval", False: phase != "train"}


def test_onnx_takes_the_draw_as_an_input_and_equals_pytorch_bit_for_bit(tmp_path):
    """On the input point the noise node reads the graph input itself, so its output must equal
    PyTorch's noised input bit for bit; the logits agree to float reordering."""
    model = linear()
    out = qtransform.transform(model, policy(point="input", apply_during="both", p=0.3))
    x = torch.randn(4, 64)
    path = qtransform.export_onnx(out, tmp_path / "m.onnx", x, dynamic=False)
    proto = onnx.load(path)
    node = next(n for n in proto.graph.node if n.op_type == "Noise")
    assert node.name == "0/input_activation_noise" and node.overload.startswith("dropout_")
    proto.graph.output.append(helper.make_empty_tensor_value_info(node.output[0]))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert names[1] == "noise:0/input"
    assert proto.graph.input[1].doc_string == (
        "draw z (uniform, fp32) of 0/input_activation_noise: dropout noise x*m/(1-p), m = (z >= p), "
        "z ~ U[0, 1); no draw disables it (export with noise='off')")
    z = torch.rand(4, 64, generator=torch.Generator().manual_seed(7))
    noise = module_of(out)
    seen = {}
    hook = noise.register_forward_hook(lambda m, args, y: seen.update(y=y))
    noise.noise_override = z
    try:
        with torch.no_grad():
            want = out(x)
    finally:
        noise.noise_override = None
        hook.remove()
    logits, noised = sess.run(None, {names[0]: x.numpy(), names[1]: z.numpy()})
    assert torch.equal(torch.from_numpy(noised), seen["y"])
    assert (noised == 0).sum() > 0
    np.testing.assert_allclose(logits, want.numpy(), rtol=1e-5, atol=1e-6)


def test_onnx_random_mode_draws_uniform_and_off_removes_it(tmp_path):
    out = qtransform.transform(linear(), policy(apply_during="both", p=0.5))
    x = torch.randn(4, 64)
    random = onnx.load(qtransform.export_onnx(out, tmp_path / "r.onnx", x, dynamic=False, noise="random"))
    draws = [n for n in random.graph.node if n.name.endswith("/draw")]
    assert [n.op_type for n in draws] == ["RandomUniformLike"]
    got = ort.InferenceSession(random.SerializeToString()).run(None, {random.graph.input[0].name: x.numpy()})[0]
    assert 0.3 < (got == 0).mean() < 0.7
    off = onnx.load(qtransform.export_onnx(out, tmp_path / "o.onnx", x, dynamic=False, noise="off"))
    assert not [n for n in off.graph.node if n.op_type == "Noise"] and len(off.graph.input) == 1


def test_plan_rows_explain_and_errors_with_their_path(tiny):
    model = tiny("qwen2")
    pol = policy(targets=["*.mlp.down_proj"], layers="1", point="input", p=0.1)
    rows = qtransform.plan(model, pol).rows
    assert [(r.site, r.pass_name, r.point, r.rule, r.detail) for r in rows] == [
        ("model.layers.1.mlp.down_proj", "activation_noise", "input", "activation_noise", "dropout p=0.1 during train")]
    assert explain(load_policy(pol)) == (
        "Activation noise: dropout y = x*m/(1-p), m ~ Bernoulli(1-p), p = 0.1, on the input activations "
        "of modules matching '*.mlp.down_proj', in layers 1, fresh every forward, during training, seed 0.")
    out = qtransform.transform(model, pol)
    with torch.no_grad():
        assert not torch.equal(out.train()(input_ids=ids()).logits, model.train()(input_ids=ids()).logits)
    errors = {
        "activation_noise.sigma: not used by distribution 'dropout' (it reads p); got 0.2": {"sigma": 0.2},
        "activation_noise.sigma: missing: required by distribution 'gaussian'": {"distribution": "gaussian", "p": None},
        "activation_noise.p: must be < 1; got 1.0": {"p": 1.0},
        "activation_noise.pp: unknown field; allowed: targets, ignore, layers, distribution, p, sigma, point, "
        "apply_during, seed (did you mean 'p'?)": {"pp": 0.1},
        "activation_noise.point: unknown value; got 'weight'; allowed: input, output": {"point": "weight"},
    }
    for message, bad in errors.items():
        with pytest.raises(PolicyError) as info:
            load_policy(policy(**bad))
        assert str(info.value) == f"invalid policy: {message}"


def test_the_dropout_kind_is_registered_with_every_part():
    kind = noise_kind("dropout")
    assert (kind.draw, kind.neutral) == ("uniform", None)
    x, z = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(kind.apply(x, z, 0.5), torch.tensor([0.0, -4.0, 6.0]))
    assert torch.equal(kind.grad(torch.ones(3), z, 0.5), torch.tensor([0.0, 2.0, 2.0]))
