"""Static scales: calibration (`transform(..., calibration=)`), freezing, saving, plans, and the
batch invariance of NVFP4 activation global scales (static and per token) on a real model."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qtransform
from qtransform import fake_quantize
from qtransform.calibration import calibrate
from qtransform.core.observers import StaticScale, static_scales
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.pipeline import transform_program
from qtransform.pipeline.saving import SCALES_FILE
from qtransform.schemas import load_policy
from qtransform.schemas.explain import explain
from tests.conftest import ids

RULE = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "tensors": ["weight", "input"]}
STATIC = {"version": 1, "quantize": [{**RULE, "scale_source": "static"}]}
TOKEN = {"version": 1, "quantize": [RULE]}
TENSOR = {"version": 1, "quantize": [{**RULE, "global_scale": "tensor"}]}


@pytest.fixture(scope="module")
def model():
    return build_tiny("qwen2")


def batches(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 7), generator=g) for _ in range(n)]


def input_amaxes(model, data, attention: str | None = None) -> dict[str, list[torch.Tensor]]:
    """max |x| of every Linear's input, per batch, in the full-precision model."""
    ref = copy.deepcopy(model)
    if attention:
        ref.config._attn_implementation = attention
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, []).append(args[0].abs().amax()))
             for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for b in data:
            ref(input_ids=b, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def scale_of(model, site: str) -> StaticScale:
    return model.get_submodule(site).input_fake_quant.static_scale


def test_static_scales_need_calibration(model):
    with pytest.raises(UserError, match=r"quantize\[0\] calibrate static scales .*calibration=batches.*--calib"):
        qtransform.transform(model, STATIC)


def test_static_minmax_is_the_largest_input_over_the_calibration_set(model):
    data = batches()
    t = qtransform.transform(model, STATIC, calibration=data)
    want = input_amaxes(model, data)
    assert set(static_scales(t)) == {f"{n}.input_fake_quant.static_scale" for n in want}
    for name, per_batch in want.items():
        assert scale_of(t, name).amax.item() == torch.stack(per_batch).amax().item()


def test_dicts_and_observers(model):
    data = batches()
    policy = {"version": 1, "quantize": [{**RULE, "scale_source": "static", "observer": "memoryless_minmax"}]}
    t = qtransform.transform(model, policy, calibration=[{"input_ids": b} for b in data])
    want = input_amaxes(model, data)
    site = "model.layers.1.mlp.down_proj"
    assert scale_of(t, site).amax.item() == want[site][-1].item()  # the last batch


def test_calibration_sees_the_full_precision_model_without_noise(model):
    data = batches()
    noisy = {**STATIC, "noise": {"schedule": {"kind": "constant", "sigma_start": 0.5, "total_steps": 10},
                                 "apply_during": "both"}}
    t = qtransform.transform(model, noisy, calibration=data)
    want = input_amaxes(model, data)
    site = "model.layers.1.self_attn.o_proj"
    assert scale_of(t, site).amax.item() == torch.stack(want[site]).amax().item()
    assert t.training is False and qtransform.noise_controller(t).modules  # noise still there


def test_eager_attention_calibration_is_put_back(model):
    data = batches()
    policy = {**STATIC, "calibration": {"attention": "eager"}}
    before = model.config._attn_implementation
    t = qtransform.transform(model, policy, calibration=data)
    assert t.config._attn_implementation == before
    want = input_amaxes(model, data, attention="eager")
    site = "model.layers.1.mlp.gate_proj"
    assert scale_of(t, site).amax.item() == torch.stack(want[site]).amax().item()


def test_static_input_uses_the_frozen_amax(model):
    data = batches()
    t = qtransform.transform(model, STATIC, calibration=data)
    site = t.model.layers[0].mlp.down_proj
    amax = site.input_fake_quant.static_scale.amax
    x = torch.randn(3, site.in_features) * 0.01  # far below the calibrated amax
    pad = torch.zeros(1, site.in_features)
    pad[0, 0] = amax  # a row holding the static amax: the stacked tensor's global scale is it
    want = fake_quantize(torch.cat([x, pad]), "nvfp4")[:-1]
    assert torch.equal(site.input_fake_quant(x), want)
    assert not torch.equal(want, fake_quantize(x, "nvfp4"))


def test_token_global_scale_is_each_rows_own(model):
    t = qtransform.transform(model, TOKEN)
    fq = t.model.layers[0].self_attn.q_proj.input_fake_quant
    x = torch.randn(2, 3, 64) * torch.tensor([0.1, 1.0, 10.0])[:, None]
    want = torch.stack([torch.stack([fake_quantize(r, "nvfp4") for r in seq]) for seq in x])
    assert torch.equal(fq(x), want)


def test_frozen_under_training_and_not_a_parameter(model):
    t = qtransform.transform(model, STATIC, calibration=batches()).train()
    before = {n: s.amax.clone() for n, s in static_scales(t).items()}
    assert list(t.state_dict()) == list(model.state_dict())
    assert not any("static_scale" in n for n, _ in t.named_parameters())
    opt = torch.optim.SGD(t.parameters(), lr=10.0)
    x = ids(2, 6)
    for _ in range(2):
        opt.zero_grad()
        t(input_ids=x, labels=x).loss.backward()
        opt.step()
    assert all(torch.equal(s.amax, before[n]) for n, s in static_scales(t).items())
    calibrate(t, batches(seed=5))  # a new calibration does change them
    assert any(not torch.equal(s.amax, before[n]) for n, s in static_scales(t).items())


def test_save_and_reload_keep_the_scales(model, tmp_path):
    t = qtransform.transform(model, STATIC, calibration=batches())
    qtransform.save_transformed(t, STATIC, tmp_path / "out")
    assert (tmp_path / "out" / SCALES_FILE).is_file()
    back = qtransform.load_transformed(tmp_path / "out")
    assert {n: s.amax.item() for n, s in static_scales(back).items()} == \
        {n: s.amax.item() for n, s in static_scales(t).items()}
    x = ids(2, 6)
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, t(input_ids=x).logits)


def test_plan_after_calibration_shows_the_values(model):
    program = transform_program(model, STATIC, calibration=batches())
    row = next(r for r in program.plan().rows if r.site == "model.layers.0.mlp.up_proj" and r.point == "input")
    amax = scale_of(program.module(), "model.layers.0.mlp.up_proj").amax.item()
    assert row.detail.endswith(f"global_scale=static (static_minmax), amax={amax:.6g}")
    assert any("static global scale" in n for n in program.plan().notes)


def test_empty_calibration_is_an_error(model):
    with pytest.raises(UserError, match="no batches"):
        qtransform.transform(model, STATIC, calibration=[])


def test_explain_says_where_activation_scales_come_from():
    assert "calibrated with the static_minmax observer, then frozen" in explain(load_policy(STATIC))
    assert "per token" in explain(load_policy(TOKEN))
    assert "depend on the other sequences" in explain(load_policy(TENSOR))


def _alone_and_batched(t, batch: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return t(input_ids=batch[i:i + 1]).logits[0], t(input_ids=batch).logits[i]


@pytest.fixture(scope="module")
def invariant_models(model):
    return {"static": qtransform.transform(model, STATIC, calibration=batches()),
            "token": qtransform.transform(model, TOKEN)}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(2, 4), length=st.integers(6, 12),
       scale=st.sampled_from([1.0, 30.0]), data=st.data())
def test_a_sequences_logits_do_not_depend_on_its_batch(model, invariant_models, seed, size, length,
                                                       scale, data):
    """Static and per-token global scales: a sequence alone equals itself in any batch, bit for
    bit; the other sequences' token embeddings are scaled up (x30) so that they dominate any
    whole-batch amax. Sequences of at least 6 tokens: below that torch's CPU matmul takes other
    kernels for one sequence than for a batch, and the full-precision model itself differs in
    the last bit (checked first, so a failure is the quantizers')."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 256, (size, length), generator=g)
    i = data.draw(st.integers(0, size - 1))
    alone, inside = _alone_and_batched(model, batch, i)
    assert torch.equal(alone, inside)  # the full-precision model is batch-invariant here
    boost = torch.where(torch.isin(torch.arange(256), batch[i]), 1.0, scale)[:, None]
    for mode, t in invariant_models.items():
        emb = t.model.embed_tokens
        saved = emb.weight.detach().clone()
        with torch.no_grad():
            emb.weight.mul_(boost)
        try:
            alone, inside = _alone_and_batched(t, batch, i)
        finally:
            with torch.no_grad():
                emb.weight.copy_(saved)
        assert torch.equal(alone, inside), mode


def test_tensor_global_scale_depends_on_the_batch(model):
    """The property above fails for global_scale "tensor": so the test can fail."""
    t = qtransform.transform(model, TENSOR)
    batch = torch.randint(0, 256, (3, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(*_alone_and_batched(model, batch, 0))
    alone, inside = _alone_and_batched(t, batch, 0)
    assert not torch.equal(alone, inside)
    assert any("Outputs depend on the batch" in n for n in qtransform.plan(model, TENSOR).notes)


def test_fp8_per_tensor_static_input_scale(model):
    """FP8 with one fp32 scale per tensor (llm-compressor's FP8 scheme): the input scale is
    amax / 448 with the static amax over the calibration set; dynamic, it is the call's own."""
    rule = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "fp8_e4m3", "granularity": "tensor",
            "tensors": ["weight", "input"]}
    data = batches()
    t = qtransform.transform(model, {"version": 1, "quantize": [{**rule, "scale_source": "static"}]},
                             calibration=data)
    site = "model.layers.1.self_attn.q_proj"
    amax = torch.stack(input_amaxes(model, data)[site]).amax()
    fq = t.get_submodule(site).input_fake_quant
    assert fq.static_scale.amax.item() == amax.item()
    x = torch.randn(2, 5, 64)
    want = fake_quantize(x, "fp8_e4m3", granularity="tensor", amax=amax)
    assert torch.equal(fq(x), want) and not torch.equal(want, fake_quantize(x, "fp8_e4m3", granularity="tensor"))
    plan = qtransform.plan(model, {"version": 1, "quantize": [rule]})
    assert any("Outputs depend on the batch" in n for n in plan.notes)  # dynamic per tensor


def test_explain_of_weight_only_rules_says_nothing_about_activations():
    for rule in ({"format": "fp8_e4m3", "granularity": "tensor"}, {"format": "nvfp4"}):
        assert "Activation" not in explain(load_policy({"version": 1, "quantize": [rule]}))


def test_static_scales_need_module_mode(model):
    with pytest.raises(UserError, match='mode="module"'):
        qtransform.transform(model, STATIC, {"input_ids": ids(1, 4)}, mode="graph", calibration=batches())


def test_peft_model_saves_and_reloads_its_static_scales(model, tmp_path):
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules="all-linear"))
    t = qtransform.transform(wrapped, STATIC, calibration=batches())
    names = set(static_scales(t))
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.input_fake_quant.static_scale" in names
    qtransform.save_transformed(t, STATIC, tmp_path / "out")
    back = qtransform.load_transformed(tmp_path / "out")
    assert {n: s.amax.item() for n, s in static_scales(back).items()} == \
        {n: s.amax.item() for n, s in static_scales(t).items()}


def test_an_activation_scan_calibrates_static_scales_on_its_own_batches(model):
    from qtransform.scan.setup import prepare_scan

    data = torch.randint(0, 256, (4, 7), generator=torch.Generator().manual_seed(2))
    setup = prepare_scan(model, STATIC, data)
    site = "model.layers.1.mlp.up_proj"
    want = torch.stack(input_amaxes(model, setup.batches)[site]).amax()
    assert scale_of(setup.program.module(), site).amax.item() == want.item()
    report = qtransform.scan_activations(model, STATIC, data)
    inputs = [r for r in report.rows if r.point == "input"]
    assert inputs and all(r.metrics["sqnr_db"] > 0 for r in inputs)  # measured on the scan's batches
