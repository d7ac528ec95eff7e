"""Hardware-error pass: statistics, injection points, phases, seeding, matmuls, export."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform
from qtransform.errors import UserError
from tests.conftest import ids
from tests.helpers import assert_untouched, snapshot


def hw_policy(**hw) -> dict:
    return {"version": 1, "hw_error": {"error_scale": 0.05, **hw}}


def single_linear(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256))


@pytest.mark.parametrize("error_type", ["relative_gaussian", "absolute_gaussian"])
def test_output_error_statistics(error_type):
    model = single_linear()
    out = qtransform.transform(model, hw_policy(error_type=error_type))
    x = torch.randn(64, 64)
    with torch.no_grad():
        clean = model(x)
        draws = torch.stack([out(x) for _ in range(4)])
    z = (draws / clean - 1) / 0.05 if error_type == "relative_gaussian" else (draws - clean) / 0.05
    assert z.std().item() == pytest.approx(1.0, rel=0.05)
    assert abs(z.mean().item()) < 0.05
    assert not torch.equal(draws[0], draws[1])  # fresh z every forward


def test_input_and_weight_points_and_noise_override():
    model = single_linear()
    x = torch.randn(8, 64)
    w, b = model[0].weight, model[0].bias
    for point, want in (("input", F.linear(x * 1.05, w, b)), ("weight", F.linear(x, w * 1.05, b))):
        out = qtransform.transform(model, hw_policy(injection_point=point))
        module = getattr(out[0], f"{point}_hw_error")
        assert module.label == f"0/{point}_hw_error"
        with torch.no_grad():
            assert not torch.equal(out(x), model(x))
            module.noise_override = torch.ones(want.shape if point == "output" else
                                               (x if point == "input" else w).shape)
            assert torch.allclose(out(x), want, rtol=0, atol=1e-6)
            module.noise_override = torch.zeros_like(module.noise_override)
            assert torch.equal(out(x), model(x))


@pytest.mark.parametrize("phase", ["train", "eval", "both"])
def test_apply_during(phase):
    model = single_linear()
    out = qtransform.transform(model, hw_policy(apply_during=phase))
    x = torch.randn(8, 64)
    with torch.no_grad():
        noisy = {mode: not torch.equal(out.train(mode)(x), model(x)) for mode in (True, False)}
    assert noisy == {True: phase != "eval", False: phase != "train"}


def test_seeded_and_gradients_flow():
    x = torch.randn(8, 64)
    runs = []
    for seed in (0, 0, 1):
        out = qtransform.transform(single_linear(), hw_policy(seed=seed))
        with torch.no_grad():
            runs.append(torch.stack([out(x), out(x)]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    out = qtransform.transform(single_linear(), hw_policy())
    out(x).pow(2).sum().backward()
    assert out[0].weight.grad.abs().sum() > 0


def test_selected_linears_in_a_transformer_and_plan(tiny):
    model = tiny("qwen2")
    before = snapshot(model)
    policy = hw_policy(targets=["*.down_proj"], layers="1", injection_point="input")
    plan = qtransform.plan(model, policy)
    assert_untouched(before, model)
    assert [(r.site, r.point) for r in plan.rows] == [("model.layers.1.mlp.down_proj", "input")]
    assert plan.rows[0].detail == "relative_gaussian s=0.05 during both"
    out = qtransform.transform(model, policy)
    assert_untouched(before, model)
    with torch.no_grad():
        assert not torch.equal(out(input_ids=ids()).logits, model(input_ids=ids()).logits)


@pytest.mark.parametrize("hw, match", [
    ({"targets": ["*.dwn_proj"]}, r"hw_error: '\*\.dwn_proj' matches no .*closest site names"),
    ({"ignore": ["lm_haed"]}, "lm_haed.*lm_head"),
    ({"targets": ["*.down_proj"], "layers": "5-7"}, r"hw_error: layers '5-7' selects no site"),
    ({"include_matmuls": True}, "include_matmuls: attention matmuls exist only in the whole-model graph"),
])
def test_a_section_that_does_nothing_is_an_error(tiny, hw, match):
    with pytest.raises(UserError, match=match):
        qtransform.transform(tiny("qwen2"), hw_policy(**hw))


def test_attention_matmuls_in_graph_mode(tiny):
    model = tiny("qwen2")
    x = ids()
    policy = hw_policy(targets=["lm_head"], include_matmuls=True, ignore=["model.layers.0.*"])
    before = snapshot(model)
    program = qtransform.transform_program(model, policy, {"input_ids": x}, mode="graph")
    assert_untouched(before, model)
    got = [(i.site, i.point) for i in program.insertions(pass_name="hw_error")]
    assert got == [("model.layers.1.self_attn.sdpa_0", "output"), ("lm_head", "output")]
    gm = program.module()
    module = gm.get_submodule(program.insertions(site="model.layers.1.self_attn.sdpa_0")[0].module_path)
    assert module.label == "model.layers.1.self_attn.sdpa_0/output_hw_error"
    with torch.no_grad():
        clean = model(input_ids=x).logits
        assert not torch.equal(gm(input_ids=x, use_cache=False).logits, clean)
        for m in gm.modules():
            if hasattr(m, "noise_override"):
                m.noise_override = torch.zeros(())
        assert torch.equal(gm(input_ids=x, use_cache=False).logits, clean)


def test_export_shows_one_noise_node_per_insertion(tiny):
    out = qtransform.transform(tiny("qwen2"), hw_policy(targets=["*.o_proj"]))
    ep = torch.export.export(out, (), {"input_ids": ids(), "use_cache": False}, strict=False)
    nodes = [n for n in ep.graph.nodes if n.target == torch.ops.qtransform.noise.default]
    assert sorted(n.args[4] for n in nodes) == [
        f"model.layers.{i}.self_attn.o_proj/output_hw_error" for i in range(2)]
    assert all(n.args[3] == "relative" and n.args[2] == 0.05 for n in nodes)


def test_a_noise_state_saved_under_another_draw_stream_is_refused():
    """Hardware error draws from stream version 2 (the Gaussian stream): a controller state of
    version 1 (or from before the key existed) would resume other draws, so it is refused."""
    out = qtransform.transform(single_linear(), hw_policy(seed=3))
    controller = qtransform.noise_controller(out)
    state = controller.state_dict()
    assert state["stream_version"] == 2
    controller.load_state_dict(state)
    for old in ({**state, "stream_version": 1}, {k: v for k, v in state.items() if k != "stream_version"}):
        with pytest.raises(UserError, match="stream version 1"):
            controller.load_state_dict(old)


def test_the_error_is_the_gaussian_streams_draw_of_its_seed_step_and_forward():
    """Forward k of step t adds s*z with z the Gaussian stream (formats/philox.py) of the
    stream's seed for (seed, site, t, k), bit for bit, in and out of a gradient."""
    from qtransform.core.noise import NoiseModule
    from qtransform.formats import philox

    out = qtransform.transform(single_linear(), hw_policy(seed=3, error_type="absolute_gaussian"))
    module = next(m for m in out.modules() if isinstance(m, NoiseModule))
    x = torch.randn(4, 64)
    clean = F.linear(x, out[0].weight, out[0].bias).detach()
    with torch.no_grad():
        first = out(x)
    second = out(x)  # with a gradient: drawn, then the formula in torch
    for k, y in enumerate((first, second)):
        z = philox.normal(module.stream.seed_at(k), (4, 256))
        assert torch.equal(y.detach(), clean + 0.05 * z)


# -- in place on a linear's own output ---------------------------------------------------------------
def _noised_pair(dtype: torch.dtype, bias: bool, error_type: str, **policy) -> tuple[nn.Module, nn.Module]:
    """The same transformed linear twice: its noise module as the graph decided, and forced to
    the out-of-place path (the reference)."""
    from qtransform.core.noise import noise_modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=bias)).to(dtype)
    pair = [qtransform.transform(model, {**hw_policy(seed=5, error_type=error_type), **policy}) for _ in range(2)]
    for m in noise_modules(pair[1]):
        m.owns_input = False
    return pair[0], pair[1]


@pytest.mark.parametrize("fast", ["1", "0"], ids=["compiled", "torch"])
@pytest.mark.parametrize("error_type", ["relative_gaussian", "absolute_gaussian"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_the_error_written_into_the_linears_output_is_the_out_of_place_result(
        monkeypatch, fast, error_type, dtype, bias):
    """Where the graph gives the noise module the linear's output alone, it writes the error
    into it: the same bits as the out-of-place path, under no_grad, with a gradient recorded
    (out of place then) and with frozen weights (in place again), for every dtype, both
    formulas, the compiled pass and torch."""
    from qtransform.core.noise import noise_modules

    monkeypatch.setenv("QTRANSFORM_FASTPATH", fast)
    inplace, reference = _noised_pair(dtype, bias, error_type)
    assert [m.owns_input for m in noise_modules(inplace)] == [True]
    for shape in ((5, 64), (2, 3, 64), (1, 1, 64)):
        x = torch.randn(shape, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(inplace(x), reference(x))
        y, want = inplace(x), reference(x)  # with a gradient: out of place in both
        assert y.requires_grad and torch.equal(y.detach(), want.detach())
        (grad,) = torch.autograd.grad(y.sum(), inplace[0].weight)
        (grad_want,) = torch.autograd.grad(want.sum(), reference[0].weight)
        assert torch.equal(grad, grad_want)
    for model in (inplace, reference):
        model.requires_grad_(False)
    x = torch.randn(3, 64, dtype=dtype)
    assert torch.equal(inplace(x), reference(x))  # grad enabled, nothing to record


@pytest.mark.parametrize("fast", ["1", "0"], ids=["compiled", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_noise_module_overwrites_only_what_it_owns(monkeypatch, fast, dtype):
    """Called directly: with `owns_input` the result is x's own memory, the out-of-place bits;
    a hook on the module (which could keep x) or a non-contiguous x keeps x unchanged."""
    from qtransform.core.noise import noise_modules

    monkeypatch.setenv("QTRANSFORM_FASTPATH", fast)

    owned, reference = (noise_modules(m)[0] for m in _noised_pair(dtype, True, "relative_gaussian"))
    owned.eval(), reference.eval()
    x = torch.randn(4, 96, dtype=dtype)
    with torch.no_grad():
        want = reference(x.clone())
        y = x.clone()
        out = owned(y)
        assert out.data_ptr() == y.data_ptr() and torch.equal(out, want) and torch.equal(y, want)
        kept = []
        handle = owned.register_forward_pre_hook(lambda module, args: kept.append(args[0].clone()) or None)
        y = x.clone()
        assert torch.equal(owned(y), reference(x.clone())) and torch.equal(y, x)
        handle.remove()
        t = x.clone().t()  # not contiguous: out of place
        assert torch.equal(owned(t), reference(x.clone().t())) and torch.equal(t, x.t())


def test_a_tap_on_the_same_output_keeps_the_noise_out_of_place(tiny):
    """An instrument tap reading the linear's raw output is a second user of the value: the
    noise module then does not own it, and the model computes the same as without the tap."""
    from qtransform.core.noise import noise_modules

    policy = {"version": 1, "hw_error": {"error_scale": 0.05, "seed": 2, "targets": ["Linear"]}}
    plain = qtransform.transform(tiny("llama"), policy)
    tapped = qtransform.transform(tiny("llama"), {**policy, "instrument": {}})
    assert all(m.owns_input for m in noise_modules(plain))
    assert not any(m.owns_input for m in noise_modules(tapped))
    x = ids()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, tapped(input_ids=x).logits)


def test_in_place_in_the_whole_model_graph(tiny):
    """In graph mode the linear and matmul op nodes' outputs are owned the same way, with the
    same results as the out-of-place path."""
    from qtransform.core.noise import noise_modules

    x = ids()
    policy = {"version": 1, "hw_error": {"error_scale": 0.05, "seed": 2, "targets": ["Linear"],
                                         "include_matmuls": True}}
    pair = [qtransform.transform(tiny("llama"), policy, {"input_ids": x}, mode="graph") for _ in range(2)]
    assert all(m.owns_input for m in noise_modules(pair[0]))
    for m in noise_modules(pair[1]):
        m.owns_input = False
    with torch.no_grad():
        got, want = (m(input_ids=x, use_cache=False).logits for m in pair)
    assert torch.equal(got, want)
