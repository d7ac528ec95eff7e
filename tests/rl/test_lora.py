"""LoRA semantics (core/lora.py): the rollout weights are the trained model, bit for bit.

Every check compares with a plain, untransformed copy of the architecture: loaded with the
rollout stream (what an engine that takes dense weights runs), or wrapped by PEFT over
fake-quantized weights written by `fake_quantize` (PEFT's own forward, the "beside" trainer).
The LoRA update is trained: two Adam steps on top of a seeded non-zero B."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform import fake_quantize
from qtransform.schemas.errors import PolicyError
from qtransform.schemas.explain import explain
from tests.tiny_rl import tiny_qwen2

peft = pytest.importorskip("peft")

IDS = torch.tensor([[5, 17, 33, 8, 90, 2, 61], [3, 44, 21, 100, 7, 12, 9]])
NOISE = {"targets": ["RMSNorm"], "seed": 3,
         "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 4, "total_steps": 8}}


def policy(fmt: str = "nvfp4", lora: str = "beside", aqn: bool = False) -> dict:
    pol = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": fmt,
                                       "lora": lora}]}
    return {**pol, "noise": NOISE} if aqn else pol


def config() -> peft.LoraConfig:
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def lora_model(order: str, pol: dict, step: int = 5) -> torch.nn.Module:
    """Both PEFT orders; B seeded non-zero (std 0.02), as a trained adapter has it."""
    torch.manual_seed(1)
    if order == "transform_first":
        model = peft.get_peft_model(qtransform.transform(tiny_qwen2(), pol), config())
    else:
        model = qtransform.transform(peft.get_peft_model(tiny_qwen2(), config()), pol)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if "noise" in pol:
        qtransform.noise_controller(model).set_step(step)
    return model


def train(model: torch.nn.Module, steps: int = 2) -> None:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(IDS).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()


def rollout_logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad(), qtransform.rollout():
        return model(IDS).logits


def engine(pairs) -> torch.nn.Module:
    plain = tiny_qwen2()
    plain.load_state_dict(dict(pairs))
    return plain


def engine_logits(pairs) -> torch.Tensor:
    with torch.no_grad():
        return engine(pairs)(IDS).logits


@pytest.mark.parametrize("aqn", [False, True], ids=["w4a16", "w4a16_aqn"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("lora", ["beside", "merged"])
@pytest.mark.parametrize("order", ["transform_first", "peft_first"])
def test_rollout_forward_equals_a_plain_model_loaded_with_the_stream(order, lora, fmt, aqn):
    model = lora_model(order, policy(fmt, lora, aqn))
    before = rollout_logits(model)  # fills the dense-weight caches
    assert torch.equal(before, engine_logits(qtransform.rollout_weights(model)))
    train(model)
    after = rollout_logits(model)  # the caches see the optimizer's writes
    assert not torch.equal(before, after)
    assert torch.equal(after, engine_logits(qtransform.rollout_weights(model)))
    greedy = model.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain = engine(qtransform.rollout_weights(model))
    assert torch.equal(greedy, plain.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0))


def quantized_reference(fmt: str) -> torch.nn.Module:
    """A plain Qwen2 whose linear weights (not lm_head) are `fake_quantize`d."""
    plain = tiny_qwen2()
    with torch.no_grad():
        for name, module in plain.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(fake_quantize(module.weight, fmt, axis=-1))
    return plain


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("order", ["transform_first", "peft_first"])
def test_beside_trains_quantized_base_plus_full_precision_adapters(order, fmt):
    model = lora_model(order, policy(fmt))
    train(model)
    reference = peft.get_peft_model(quantized_reference(fmt), config())  # PEFT's own forward
    adapters = {n: p for n, p in model.state_dict().items() if "lora_" in n}
    reference.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        trainer = model(IDS).logits
        assert torch.equal(trainer, reference(IDS).logits)  # quant(W) x + s B A x
    rollout = rollout_logits(model)  # (quant(W) + s B A) x: the same model, rounded otherwise
    assert not torch.equal(trainer, rollout)
    torch.testing.assert_close(trainer, rollout, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("order", ["transform_first", "peft_first"])
def test_merged_trains_the_quantized_merged_weight(order, fmt):
    model = lora_model(order, policy(fmt, "merged"))
    train(model)
    with torch.no_grad():
        trainer = model(IDS).logits
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.1.self_attn.q_proj"))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = layer.base_layer.weight
    want = fake_quantize((w + b @ a * layer.scaling["default"]).detach(), fmt, axis=-1)
    stream = dict(qtransform.rollout_weights(model))
    assert torch.equal(stream["model.layers.1.self_attn.q_proj.weight"], want)
    assert torch.equal(trainer, engine_logits(stream.items()))  # training forward: quant(W + s B A)
    model(IDS).logits.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_" in n)
    assert all(g is None for n, g in grads.items() if "lora_" not in n)


def test_the_dense_weight_is_what_trained_and_rollout_forwards_differ_in():
    """quant(W) x + s B (A x) and (quant(W) + s B A) x differ by rounding: the reason a rollout
    computes with the dense weight (an engine does)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 64), fake_quantize(torch.randn(96, 64), "nvfp4")
    a, b = torch.randn(8, 64) / 8, torch.randn(96, 8) / 50
    beside = x @ w.T + (x @ a.T) @ b.T * 2.0
    dense = x @ (w + b @ a * 2.0).T
    assert not torch.equal(beside, dense)


@pytest.mark.parametrize("lora", ["beside", "merged"])
def test_filter_of_a_peft_merged_stream_equals_the_model_after_the_unmerge(lora):
    """TRL's sync (and verl's lora.merge) stream W + s B A while PEFT has the adapters merged;
    the filtered stream equals what the trainer's model computes after PEFT's unmerge."""
    model = lora_model("transform_first", policy("nvfp4", lora, aqn=True))
    train(model)
    model.merge_adapter()
    stream = [(n.removeprefix("base_model.model.").replace(".base_layer", ""), t.clone())
              for n, t in model.state_dict().items() if "lora_" not in n]
    filtered = dict(qtransform.rollout_filter(model, stream))
    model.unmerge_adapter()
    direct = dict(qtransform.rollout_weights(model))
    assert filtered.keys() == direct.keys()
    assert all(torch.equal(filtered[k], direct[k]) for k in direct)
    assert torch.equal(rollout_logits(model), engine_logits(filtered.items()))


def test_an_engine_with_its_own_lora_gets_the_quantized_base():
    model = lora_model("peft_first", policy())
    train(model)
    base = dict(qtransform.rollout_weights(model, merge_lora=False))
    w = model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    assert torch.equal(base["model.layers.0.mlp.down_proj.weight"], fake_quantize(w.detach(), "nvfp4"))
    merged = lora_model("peft_first", policy(lora="merged"))
    with pytest.raises(qtransform.UserError, match="lora='merged'.*merge_lora=True"):
        dict(qtransform.rollout_weights(merged, merge_lora=False))


def test_lora_option_is_validated_and_explained():
    with pytest.raises(PolicyError, match="lora"):
        qtransform.load_policy({"version": 1, "quantize": [
            {"targets": ["Linear"], "format": "nvfp4", "tensors": ["input"], "lora": "merged"}]})
    with pytest.raises(PolicyError, match="lora"):
        qtransform.load_policy({"version": 1, "quantize": [
            {"targets": ["Linear"], "format": "nvfp4", "lora": "fused"}]})
    text = explain(qtransform.load_policy(policy(lora="merged")))
    assert "quant(W + s B A) (lora: merged)" in text


def test_aqn_draws_are_keyed_on_the_base_model_name():
    """Both PEFT orders, same seed and step: the same noised norms and the same logits."""
    first = lora_model("transform_first", policy(aqn=True))
    second = lora_model("peft_first", policy(aqn=True))
    a, b = dict(qtransform.rollout_weights(first)), dict(qtransform.rollout_weights(second))
    assert not torch.equal(a["model.norm.weight"], tiny_qwen2().model.norm.weight)  # noised
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(rollout_logits(first), rollout_logits(second))
    assert (qtransform.noise_controller(first).state_dict()
            == qtransform.noise_controller(second).state_dict())


def test_a_fake_quantizer_switched_off_is_off_in_the_stream_too():
    """Sensitivity scans switch one site's fake quantization off (`enabled`): the dense weight
    and the stream follow, with and without LoRA on the site."""
    model = lora_model("transform_first", policy())
    train(model)
    for name, module in model.named_modules():
        if name.endswith(("layers.0.self_attn.q_proj.base_layer.weight_fake_quant",
                          "layers.1.mlp.up_proj.base_layer.weight_fake_quant")):
            module.enabled = False
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    stream = dict(qtransform.rollout_weights(model))
    w, delta = layer.base_layer.weight.detach(), layer.get_delta_weight("default").detach()
    assert torch.equal(stream["model.layers.0.self_attn.q_proj.weight"], w + delta)  # unquantized
    assert torch.equal(rollout_logits(model), engine_logits(stream.items()))
