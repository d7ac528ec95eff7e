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
