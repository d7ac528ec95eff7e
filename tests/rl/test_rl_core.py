"""RL core: the rollout phase, rollout weights (source and filter), counters and the end-of-run
warning, gradient checkpointing. Expected values come from a plain copy of the model whose weights
are written by the format functions and by the documented noise draw, not from qtransform's
modules."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import qtransform
from qtransform.formats import fake_quantize
from qtransform.models import build_tiny

SCHEDULE = {"kind": "exponential", "sigma_start": 0.05, "sigma_end": 0.005, "num_stages": 4,
            "total_steps": 40}  # noise from step 10 on
W4 = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}
POLICY = {"version": 1, "quantize": [W4], "noise": {"schedule": SCHEDULE, "seed": 3}}


def tiny_qwen2(seed: int = 0, layers: int = 2) -> nn.Module:
    return build_tiny("qwen2", num_layers=layers, seed=seed, vocab=96)


def documented_z(seed: int, site: str, step: int, shape: torch.Size) -> torch.Tensor:
    """docs/noise.md: z of a step is torch.randn from a generator seeded with the 63-bit
    little-endian blake2b-8 hash of "seed/site/step", shifted right by one."""
    digest = hashlib.blake2b(f"{seed}/{site}/{step}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=gen)


def sigma(step: int) -> float:
    """The exponential schedule above at `step`: K=4 intervals of 10 steps, interval 0 clean."""
    stage = min(step * 4 // 40, 3)
    return 0.0 if stage == 0 else 0.05 * (0.005 / 0.05) ** ((stage - 1) / 2)


def rollout_reference(model: nn.Module, step: int) -> nn.Module:
    """A plain copy whose weights are what the rollout computes with at `step`."""
    ref = tiny_qwen2()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(fake_quantize(module.weight, "nvfp4", axis=-1))
            elif type(module).__name__.endswith("RMSNorm"):
                z = documented_z(3, name, step, module.weight.shape)
                module.weight.add_(sigma(step) * z)
    return ref


def test_aqn_applies_only_in_rollouts_by_default():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    clean = qtransform.transform(tiny_qwen2(), {"version": 1, "quantize": [W4]})
    qtransform.noise_controller(model).set_step(25)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        want_clean = clean(ids).logits
        for mode in (model.train, model.eval):  # training loss, log-probs, reference model
            mode()
            assert torch.equal(model(ids).logits, want_clean)
        model.eval()
        with qtransform.rollout():
            noisy = model(ids).logits
        expected = rollout_reference(model, 25)(ids).logits
    torch.testing.assert_close(noisy, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(noisy, want_clean, atol=1e-3)


def test_generate_is_a_rollout():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(12)
    ids = torch.randint(0, 96, (1, 5))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True,
              "return_dict_in_generate": True, "pad_token_id": 0}
    got = model.generate(ids, **kwargs)
    want = rollout_reference(model, 12).generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    report = qtransform.noise_controller(model).report()
    assert report["noised_forwards"] == 6 and report["syncs"] == 0


def test_rollout_weights_load_into_the_plain_architecture():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(31)
    pairs = list(qtransform.rollout_weights(model))
    plain = tiny_qwen2(seed=9)
    assert [n for n, _ in pairs] == list(plain.state_dict())
    plain.load_state_dict(dict(pairs))
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad(), qtransform.rollout():
        assert torch.equal(plain(ids).logits, model(ids).logits)
    ref = rollout_reference(model, 31).state_dict()
    for name, tensor in pairs:
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6)
    report = qtransform.noise_controller(model).report()
    assert report["noised_syncs"] == 1 and report["forwards"] == 1


def test_rollout_filter_transforms_another_systems_stream():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(20)
    stream = ((name, tensor.clone()) for name, tensor in tiny_qwen2().state_dict().items())
    filtered = dict(qtransform.rollout_filter(model, stream))
    direct = dict(qtransform.rollout_weights(model))
    assert filtered.keys() == direct.keys()
    assert all(torch.equal(filtered[k], direct[k]) for k in direct)


def test_rollout_weights_merge_lora_under_hugging_face_names():
    peft = pytest.importorskip("peft")
    base = tiny_qwen2()
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    model = qtransform.transform(lora, {"version": 1, "quantize": [W4]})
    merged = dict(qtransform.rollout_weights(model))
    unmerged = dict(qtransform.rollout_weights(model, merge_lora=False))
    assert list(merged) == list(tiny_qwen2().state_dict())
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = layer.base_layer.weight
    delta = ((b @ a) * layer.scaling["default"]).detach()
    want = fake_quantize(w.detach(), "nvfp4", axis=-1) + delta  # lora="beside": quant(W) + s B A
    assert torch.equal(merged["model.layers.1.self_attn.q_proj.weight"], want)
    assert torch.equal(unmerged["model.layers.1.self_attn.q_proj.weight"],
                       fake_quantize(w.detach(), "nvfp4", axis=-1))


def test_disabled_turns_off_hardware_error_too():
    pol = {**POLICY, "hw_error": {"error_scale": 0.05, "targets": ["Linear"], "ignore": ["lm_head"]}}
    model = qtransform.transform(tiny_qwen2(), pol)
    clean = qtransform.transform(tiny_qwen2(), {"version": 1, "quantize": [W4]})
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, clean(ids).logits)
        with qtransform.noise_controller(model).disabled(), qtransform.rollout():
            assert torch.equal(model(ids).logits, clean(ids).logits)


def test_silent_aqn_is_explained():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    controller = qtransform.noise_controller(model)
    ids = torch.randint(0, 96, (1, 4))
    with torch.no_grad(), qtransform.rollout():
        model(ids)  # step 0: the noise-free first interval
    assert "never went past step 0" in controller.report()["silent"]
    assert "first noisy step is 10" in controller.report()["silent"]
    controller.set_step(15)
    with torch.no_grad():
        model(ids)  # an ordinary forward: not a rollout
    assert controller.report()["silent"] == (
        "AQN never applied noise: apply_during='rollout', and none of the 1 forwards/syncs at noisy "
        "steps ran in that phase (generate(), `with qtransform.rollout():` or rollout_weights)")
    with torch.no_grad(), qtransform.rollout(), controller.disabled():
        model(ids)
    assert controller.report()["silent"].endswith("it was disabled (noise.disabled()) whenever it could apply")
    with torch.no_grad(), qtransform.rollout():
        model(ids)
    assert controller.report()["silent"] is None and controller.report()["noised_forwards"] == 1


def test_a_run_that_never_applied_aqn_ends_with_a_warning(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import torch, qtransform
        from qtransform.models import build_tiny
        model = qtransform.transform(build_tiny("qwen2", num_layers=1, vocab=96), {POLICY!r})
        model.train()
        for _ in range(3):
            model(torch.randint(0, 96, (1, 5))).logits.sum().backward()
    """))
    run = subprocess.run([sys.executable, "-W", "default", str(script)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "AQN never applied noise: the noise controller never went past step 0" in run.stderr


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_replays_the_forwards_noise(reentrant):
    pol = {"version": 1, "quantize": [{**W4, "rounding": "stochastic", "seed": 1}],
           "noise": {"schedule": SCHEDULE, "resample": "forward", "apply_during": "train"},
           "hw_error": {"error_scale": 0.02, "targets": ["Linear"], "ignore": ["lm_head"],
                        "apply_during": "train"}}
    ids = torch.randint(0, 96, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model = qtransform.transform(tiny_qwen2(), pol)
        qtransform.noise_controller(model).set_step(20)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_rollout_weights_carry_quantized_experts_under_hf_names(arch):
    from qtransform.models import build_tiny

    model = qtransform.transform(build_tiny(arch), {"version": 1, "quantize": [{**W4, "format": "mxfp4"}]})
    pairs = dict(qtransform.rollout_weights(model))
    plain = build_tiny(arch, seed=5)
    assert list(pairs) == list(plain.state_dict())
    experts = [k for k in pairs if k.endswith("experts.gate_up_proj")]
    assert experts
    raw = build_tiny(arch).state_dict()[experts[0]]
    want = torch.stack([fake_quantize(raw[e], "mxfp4", axis=-1) for e in range(raw.shape[0])])
    assert torch.equal(pairs[experts[0]], want)  # each expert as its own nn.Linear weight would be
    plain.load_state_dict(pairs)
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad(), qtransform.rollout():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_aqn_on_fused_experts_reaches_the_rollout_weights():
    from qtransform.models import build_tiny

    noise = {"targets": ["re:.*experts.down_proj"], "seed": 3, "schedule": SCHEDULE}
    model = qtransform.transform(build_tiny("qwen2_moe"), {"version": 1, "noise": noise})
    qtransform.noise_controller(model).set_step(25)
    pairs = dict(qtransform.rollout_weights(model))
    clean = build_tiny("qwen2_moe").state_dict()
    name = "model.layers.1.mlp.experts.down_proj"
    want = clean[name] + sigma(25) * documented_z(3, name, 25, clean[name].shape)
    torch.testing.assert_close(pairs[name], want, rtol=0, atol=1e-7)
    assert torch.equal(pairs["model.layers.1.mlp.experts.gate_up_proj"], clean["model.layers.1.mlp.experts.gate_up_proj"])
    ids = torch.randint(0, 64, (1, 6))
    plain = build_tiny("qwen2_moe")
    plain.load_state_dict(pairs)
    with torch.no_grad(), qtransform.rollout():
        assert torch.equal(plain(ids).logits, model(ids).logits)


def test_hardware_error_reaches_fused_expert_outputs_and_switches_off():
    """The error sits on each expert down-projection output; disabled() gives the clean model."""
    from qtransform.models import build_tiny

    model = build_tiny("mixtral")
    pol = {"version": 1, "hw_error": {"error_scale": 0.05, "targets": ["re:.*experts.down_proj"], "seed": 4}}
    noisy = qtransform.transform(model, pol)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        clean = model(ids).logits
        got = noisy(ids).logits
        assert not torch.equal(got, clean)
        with qtransform.noise_controller(noisy).disabled():
            assert torch.equal(noisy(ids).logits, clean)
    rows = [(r.site, r.point) for r in qtransform.plan(model, pol).rows]
    assert rows == [(f"model.layers.{i}.mlp.experts.down_proj", "output") for i in (0, 1)]
