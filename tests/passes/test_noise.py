"""AQN noise: a node on norm weights, never a write; the controller, seeding, phases, checkpoints."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch

import qtransform
from qtransform.core.schedule import sigma_at
from qtransform.core.streams import REPLAYABLE, DrawStream, in_backward, site_seed
from qtransform.errors import UserError
from qtransform.passes.aqn_noise import AQNNoise
from qtransform.schemas.sections.noise import describe_noise
from tests.conftest import ids
from tests.helpers import assert_untouched, snapshot

SCHEDULE = {"sigma_start": 0.01, "sigma_end": 0.0001, "num_stages": 10, "total_steps": 100}
W4 = {"name": "w4", "targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight"]}


def noise_policy(**noise) -> dict:
    return {"version": 1, "noise": {"schedule": SCHEDULE, **noise}}


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logits(model, x=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids() if x is None else x).logits


def test_noise_is_a_node_params_never_written_and_buffers_hidden(tiny):
    model = tiny("qwen2")
    untouched = snapshot(model)
    out = qtransform.transform(model, noise_policy(apply_during="both"))
    assert_untouched(untouched, model)
    before = params(out)
    assert list(before) == list(model.state_dict())  # z is not in state_dict
    assert not any("aqn" in n for n, _ in out.named_parameters())
    controller = qtransform.noise_controller(out)
    assert len(controller.modules) == 5  # 2 layers x 2 norms + final norm
    for step in range(0, 100, 3):
        controller.set_step(step)
        logits(out)
    after = params(out)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "qtransform.core.schedule" not in str(type(out))  # the user's class is kept


def test_disabled_and_eval_are_bit_identical_to_the_clean_transformed_model(tiny):
    model = tiny("qwen2")
    clean = qtransform.transform(model, {"version": 1, "quantize": [W4]})
    noisy = qtransform.transform(model, {"version": 1, "quantize": [W4], **noise_policy(apply_during="train")})
    controller = qtransform.noise_controller(noisy)
    controller.set_step(50)
    want = logits(clean)
    assert torch.equal(logits(noisy), want)  # apply_during "train" and the model is in eval
    noisy.train()
    assert not torch.equal(logits(noisy), want)
    with controller.disabled():
        assert torch.equal(logits(noisy), want)
    assert not torch.equal(logits(noisy), want)
    controller.set_step(5)  # interval 0: sigma 0
    assert torch.equal(logits(noisy), want)


def test_empirical_std_equals_sigma_times_multiplier(tiny):
    constant = {"kind": "constant", "sigma_start": 0.02, "num_stages": 2, "total_steps": 10}
    policy = {"version": 1, "noise": {"schedule": constant, "layer_multipliers": {"1": 1.5},
                                      "apply_during": "both"}}
    out = qtransform.transform(tiny("qwen2"), policy)
    controller = qtransform.noise_controller(out)
    site = "model.layers.1.input_layernorm"
    module, gamma = controller.modules[site], out.model.layers[1].input_layernorm.weight
    samples = []
    for step in range(5, 205):
        controller.set_step(step)
        samples.append((module(gamma) - gamma).detach())
    assert controller.sigma()[site] == pytest.approx(0.03)
    noise = torch.cat(samples)
    assert noise.std().item() == pytest.approx(0.03, rel=0.05) and abs(noise.mean().item()) < 0.003


def test_same_seed_same_noise_sites_independent_and_resample_modes(tiny):
    model = tiny("qwen2")
    a, b, c = (qtransform.noise_controller(qtransform.transform(model, noise_policy(seed=s))) for s in (0, 0, 1))
    site0, site1 = "model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"
    za, zb = [], []
    for step in range(100):
        for ctl in (a, b, c):
            ctl.set_step(step)
        assert torch.equal(a.modules[site0].z, b.modules[site0].z)
        assert not torch.equal(a.modules[site0].z, c.modules[site0].z)
        za.append(a.modules[site0].z.clone())
        zb.append(a.modules[site1].z.clone())
    corr = torch.corrcoef(torch.stack([torch.cat(za), torch.cat(zb)]))[0, 1]
    assert abs(corr) < 0.05
    per_step = qtransform.transform(model, noise_policy(apply_during="both"))
    per_forward = qtransform.transform(model, noise_policy(apply_during="both", resample="forward"))
    for out in (per_step, per_forward):
        qtransform.noise_controller(out).set_step(50)
    clean, first = logits(model), logits(per_step)
    assert not torch.equal(first, clean)  # noise is applied (apply_during both, sigma > 0)
    assert torch.equal(logits(per_step), first)  # "step": one draw per step, every forward
    qtransform.noise_controller(per_step).set_step(51)
    assert not torch.equal(logits(per_step), first)
    qtransform.noise_controller(per_step).set_step(50)
    assert torch.equal(logits(per_step), first)  # the draw is a function of (seed, site, step)
    a, b = logits(per_forward), logits(per_forward)
    assert not torch.equal(a, b) and not torch.equal(a, clean)


def test_z_is_a_float32_draw_of_seed_site_step_cast_to_the_weight_dtype(tiny):
    out = qtransform.transform(tiny("qwen2", dtype=torch.bfloat16), noise_policy(seed=7, apply_during="both"))
    controller = qtransform.noise_controller(out)
    controller.set_step(33)
    site = "model.layers.1.input_layernorm"
    generator = torch.Generator().manual_seed(site_seed(7, site, 33))
    want = torch.randn(64, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    module = controller.modules[site]
    assert module.z.dtype == torch.bfloat16 and torch.equal(module.z, want)
    gamma = out.model.layers[1].input_layernorm.weight
    assert torch.equal(module(gamma), gamma + module.sigma * want)


def test_controller_state_round_trips_through_a_checkpoint(tiny):
    model = tiny("qwen2")
    policy = noise_policy(apply_during="both", resample="forward", seed=3)
    first = qtransform.transform(model, policy)
    controller = qtransform.noise_controller(first)
    for _ in range(42):
        controller.step()
    logits(first)  # a forward inside the step advances the per-forward stream
    buffer = io.BytesIO()
    torch.save(controller.state_dict(), buffer)
    second = qtransform.transform(model, policy)
    restored = qtransform.noise_controller(second)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    assert restored.current_step == 42 and restored.sigma() == controller.sigma()
    assert torch.equal(logits(first), logits(second))
    with pytest.raises(UserError, match="seed"):
        qtransform.noise_controller(qtransform.transform(model, noise_policy(seed=4))).load_state_dict(
            controller.state_dict())


def test_gradients_flow_through_noise_and_fake_quant_nodes(tiny):
    out = qtransform.transform(tiny("qwen2"), {"version": 1, "quantize": [W4], **noise_policy()}).train()
    qtransform.noise_controller(out).set_step(50)
    out(input_ids=ids(), labels=ids()).loss.backward()
    layer = out.model.layers[0]
    assert layer.input_layernorm.weight.grad.abs().sum() > 0
    assert layer.mlp.up_proj.weight.grad.abs().sum() > 0


def test_plan_lists_every_noised_site_with_its_multiplier(tiny):
    policy = noise_policy(layer_multipliers={"1": 1.5},
                          multipliers=[{"targets": ["*.input_layernorm"], "value": 1.2}])
    plan = qtransform.plan(tiny("qwen2"), policy)
    rows = {r.site: r.detail for r in plan.rows}
    assert len(rows) == 5
    assert "sigma x1.5 (layer 1), during rollout;" in rows["model.layers.1.post_attention_layernorm"]
    assert "sigma x1.2 (multipliers[0]), during rollout;" in rows["model.layers.0.input_layernorm"]
    assert "sigma x1.8 (layer 1 x1.5, multipliers[0] x1.2)" in rows["model.layers.1.input_layernorm"]
    assert rows["model.norm"].startswith("exponential 0.01->0.0001 K=10, sigma x1")


@pytest.mark.parametrize("noise, match", [
    ({"targets": ["*.input_layernrm"]}, r"input_layernrm.*closest site names"),
    ({"layers": "10-17"}, r"noise: layers '10-17' selects no site"),
    ({"layer_multipliers": {"7": 2.0}}, r"layer_multipliers: layer 7 has no noised site"),
    ({"multipliers": [{"targets": ["*.q_prj"], "value": 2.0}]}, r"multipliers\[0\]: '\*\.q_prj' matches no"),
    ({"multipliers": [{"targets": ["lm_head"], "value": 2.0}]}, r"multipliers\[0\]: matches only sites"),
])
def test_a_noise_section_that_does_nothing_is_an_error(tiny, noise, match):
    with pytest.raises(UserError, match=match):
        qtransform.transform(tiny("qwen2"), noise_policy(**noise))


def test_linear_weights_can_be_targeted(tiny):
    model = tiny("qwen2")
    out = qtransform.transform(model, noise_policy(targets=["Linear"], ignore=["lm_head"], apply_during="both"))
    controller = qtransform.noise_controller(out)
    assert len(controller.modules) == 14 and "model.layers.0.mlp.up_proj" in controller.modules
    controller.set_step(50)
    assert not torch.equal(logits(out), logits(model))
    assert all(torch.equal(a, b) for a, b in zip(out.state_dict().values(), model.state_dict().values(), strict=True))


def test_export_shows_one_noise_node_per_site_and_override(tiny):
    out = qtransform.transform(tiny("qwen2"), noise_policy(apply_during="both"))
    controller = qtransform.noise_controller(out)
    controller.set_step(50)
    ep = torch.export.export(out, (), {"input_ids": ids(), "use_cache": False}, strict=False)
    nodes = [n for n in ep.graph.nodes if n.target == torch.ops.qtransform.noise.default]
    assert sorted(n.args[4] for n in nodes)[0] == "model.layers.0.input_layernorm/weight_noise"
    assert len(nodes) == 5 and all(n.args[3] == "add" for n in nodes)
    with torch.no_grad():
        assert torch.equal(ep.module()(input_ids=ids(), use_cache=False).logits, logits(out))
    module: AQNNoise = controller.modules["model.norm"]
    module.noise_override = torch.ones_like(module.z)
    w = out.model.norm.weight
    assert torch.equal(module(w), w + module.sigma * torch.ones_like(w))


def test_graph_mode_noise_and_controller(tiny):
    model = tiny("qwen2")
    x = ids()
    gm = qtransform.transform(model, noise_policy(apply_during="both"), {"input_ids": x}, mode="graph")
    controller = qtransform.noise_controller(gm)
    assert len(controller.modules) == 5
    clean = logits(model, x)
    assert torch.equal(gm(input_ids=x, use_cache=False).logits, clean)  # step 0: noise-free
    controller.set_step(50)
    with torch.no_grad():
        assert not torch.equal(gm(input_ids=x, use_cache=False).logits, clean)
        with controller.disabled():
            assert torch.equal(gm(input_ids=x, use_cache=False).logits, clean)


def test_training_smoke_w4a16_mxfp4_with_aqn(tiny):
    """A few dozen AdamW steps on a fixed batch: loss goes down, sigma follows the schedule."""
    schedule = {"sigma_start": 0.01, "sigma_end": 0.0001, "num_stages": 5, "total_steps": 30}
    out = qtransform.transform(tiny("qwen2"), {"version": 1, "quantize": [W4],
                                               "noise": {"schedule": schedule}}).train()
    controller = qtransform.noise_controller(out)
    opt = torch.optim.AdamW(out.parameters(), lr=3e-3)
    x = ids(4, 16)
    losses = []
    for step in range(36):
        # hand-worked: stage = min(step * 5 // 30, 4); stage 0 is noise-free, stages 1-4 go
        # geometrically from 0.01 to 0.0001 (ratio 0.01 ** (1/3))
        stage = min(step * 5 // 30, 4)
        sigma = 0.0 if stage == 0 else 0.01 * 0.01 ** ((stage - 1) / 3)
        assert list(controller.sigma().values()) == pytest.approx([sigma] * 5, rel=1e-12)
        loss = out(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        controller.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert controller.current_step == 36
    assert list(controller.sigma().values()) == pytest.approx([0.0001] * 5, rel=1e-12)


def test_site_seed_is_the_documented_blake2b_hash():
    # docs/noise.md: first 8 bytes of blake2b("{seed}/{site}/{step}[/{index}]"), little-endian, >> 1
    for seed, site, step, index in ((7, "model.layers.1.input_layernorm", 33, None), (0, "lm_head", 0, 5)):
        key = f"{seed}/{site}/{step}" + ("" if index is None else f"/{index}")
        want = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") // 2
        assert site_seed(seed, site, step, index) == want < 2**63
    assert site_seed(7, "a", 1) == 0x2E290C97378B8549  # pinned: a change re-seeds every saved run


def test_draw_indices_are_fresh_forward_and_replayed_newest_first_in_backward():
    stream = DrawStream(3, "site")
    seen: list[int] = []
    assert not in_backward()
    with torch.no_grad():
        assert stream.next_index() == 0  # eval forward without a graph: not replayable
    assert [stream.next_index(), stream.next_index()] == [1, 2]  # grad-enabled: remembered
    with torch.no_grad():
        assert stream.next_index(training=True) == 3  # reentrant checkpoint's first forward
    assert stream.count == 4

    def recompute(grad):
        seen.append(in_backward())
        seen.extend(stream.next_index() for _ in range(4))  # 3 replays, then a fresh index
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(recompute)
    y.sum().backward()
    assert seen == [True, 3, 2, 1, 4] and stream.count == 5
    stream.set_step(9, count=2)
    assert (stream.step, stream.next_index()) == (9, 2)


def test_replay_memory_is_bounded_and_one_generator_per_device():
    stream = DrawStream(0, "site")
    for _ in range(REPLAYABLE + 2):
        stream.next_index()
    seen: list[int] = []
    x = torch.ones(1, requires_grad=True)
    y = x * 1
    y.register_hook(lambda g: seen.extend(stream.next_index() for _ in range(REPLAYABLE + 1)) or g)
    y.sum().backward()
    # the newest REPLAYABLE forwards are replayed (REPLAYABLE + 1 down to 2), then a fresh index
    assert seen == [*range(REPLAYABLE + 1, 1, -1), REPLAYABLE + 2]
    cpu = torch.device("cpu")
    assert stream.generator(cpu, 0) is stream.generator(cpu, 1)  # re-seeded, not re-allocated


@pytest.mark.parametrize("distribution, sampler", [("normal", torch.randn), ("uniform", torch.rand)])
def test_stream_draws_are_float32_from_the_draws_generator(distribution, sampler):
    stream = DrawStream(5, "w")
    stream.set_step(4)
    cpu = torch.device("cpu")
    got = stream.sample(distribution, torch.Size([3, 8]), cpu, index=1)
    want = sampler(3, 8, generator=torch.Generator().manual_seed(site_seed(5, "w", 4, 1)))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(stream.sample(distribution, torch.Size([3, 8]), cpu, index=1), got)  # reseeded per draw
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # models built under another default draw the same z
    try:
        assert torch.equal(stream.sample(distribution, torch.Size([3, 8]), cpu, index=1), got)
    finally:
        torch.set_default_dtype(default)


def scaled_norms(model) -> torch.nn.Module:
    """Norm weights at SmolLM2-like scales: 0.027 on layer 0's input norm, 0.25 elsewhere."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.weight.fill_(0.027 if name == "model.layers.0.input_layernorm" else 0.25)
    return model


def test_plan_shows_sigma_relative_to_each_norms_mean_abs_weight(tiny):
    plan = qtransform.plan(scaled_norms(tiny("qwen2")), noise_policy())
    rows = {r.site: r.detail for r in plan.rows}
    ratio = 0.01 / torch.tensor(0.027, dtype=torch.float32).double().item()  # the fp32 weight
    assert rows["model.layers.0.input_layernorm"].endswith(
        f"sigma_start 0.01 = {ratio:.3g} x mean |w| 0.027")
    assert rows["model.norm"].endswith("sigma_start 0.01 = 0.04 x mean |w| 0.25")
    assert plan.notes == [
        f"AQN sigma_start relative to each site's mean |w|: min 0.04 at "
        f"model.layers.0.post_attention_layernorm (mean |w| 0.25), median 0.04, max {ratio:.3g} at "
        "model.layers.0.input_layernorm (mean |w| 0.027); over 5 sites"]
    assert plan.to_text().endswith(plan.notes[0])
    transformed = qtransform.transform_program(scaled_norms(tiny("qwen2")), noise_policy())
    assert transformed.plan().notes == plan.notes  # the same after the transform


def test_relative_sigma_is_a_fraction_of_each_sites_mean_abs_weight(tiny):
    model = scaled_norms(tiny("qwen2"))
    policy = noise_policy(sigma_scale="mean_abs", layer_multipliers={"1": 2.0})
    out = qtransform.transform(model, policy)
    controller = qtransform.noise_controller(out)
    controller.set_step(50)
    sigma_t = sigma_at(50, qtransform.load_policy(policy).noise.schedule)
    weights = dict(qtransform.rollout_weights(out))
    for site, m_site in (("model.layers.0.input_layernorm", 1.0), ("model.norm", 1.0),
                         ("model.layers.1.input_layernorm", 2.0)):
        w = model.get_submodule(site).weight.detach()
        sigma = sigma_t * (m_site * w.double().abs().mean().item())
        assert controller.sigma()[site] == sigma
        digest = hashlib.blake2b(f"0/{site}/50".encode(), digest_size=8).digest()  # docs/noise.md
        z = torch.randn(w.shape, generator=torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1))
        torch.testing.assert_close(weights[f"{site}.weight"], w + sigma * z, rtol=0, atol=1e-9)
    rows = {r.site: r.detail for r in qtransform.plan(model, noise_policy(sigma_scale="mean_abs")).rows}
    assert rows["model.layers.0.input_layernorm"].endswith("= 0.01 x mean |w| 0.027")
    explained = describe_noise(qtransform.load_policy(policy).noise)
    assert "  Sigma is a fraction of each site's mean |w| (sigma_scale mean_abs)." in explained


def test_relative_sigma_refuses_a_zero_weight(tiny):
    model = tiny("qwen2")
    with torch.no_grad():
        model.model.norm.weight.zero_()
    with pytest.raises(UserError, match="model.norm has mean \\|w\\| 0"):
        qtransform.transform(model, noise_policy(sigma_scale="mean_abs"))
