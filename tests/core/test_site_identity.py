"""A transformed site keeps its identity: same class, same Parameter objects, hooks still fire,
PEFT can wrap it, and the graph it runs is still what passes edit and export reads."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen2ForCausalLM

import qtransform
from qtransform.formats import fake_quantize
from qtransform.models import build_tiny

W4 = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}


def tiny_qwen2(seed: int = 0) -> nn.Module:
    return build_tiny("qwen2", seed=seed, vocab=128)


def test_sites_stay_instances_of_their_class_with_their_own_parameters():
    model = tiny_qwen2()
    q = model.model.layers[0].self_attn.q_proj
    norm = model.model.layers[0].input_layernorm
    weight, norm_weight, keys = q.weight, norm.weight, list(model.state_dict())
    pol = {**W4, "noise": {"targets": ["RMSNorm"], "schedule": {"sigma_start": 0.01, "sigma_end": 0.001, "total_steps": 10}}}
    out = qtransform.transform(model, pol, inplace=True)
    assert out is model
    assert type(q) is nn.Linear and isinstance(q, nn.Linear)
    assert model.model.layers[0].self_attn.q_proj is q and q.weight is weight
    assert (q.in_features, q.out_features) == (64, 64)
    assert type(norm).__name__ == "Qwen2RMSNorm" and norm.weight is norm_weight
    assert list(model.state_dict()) == keys


def test_the_site_computes_with_the_fake_quantized_weight():
    model = tiny_qwen2()
    q = qtransform.transform(model, W4).model.layers[1].mlp.down_proj
    x = torch.randn(3, 5, 128)
    expected = x @ fake_quantize(q.weight.detach(), "mxfp4", axis=-1).T  # no bias on down_proj
    assert torch.equal(q(x), expected)


def test_user_hooks_keep_firing_after_transform():
    model = tiny_qwen2()
    q = model.model.layers[0].self_attn.q_proj
    seen: list[str] = []
    q.register_forward_pre_hook(lambda m, a: seen.append("pre"))
    q.register_forward_hook(lambda m, a, o: seen.append("post"))
    q.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    q.weight.register_hook(lambda g: seen.append("grad") or g)
    qtransform.transform(model, W4, inplace=True)
    model.train()
    model(torch.randint(0, 128, (1, 6)), labels=torch.randint(0, 128, (1, 6))).loss.backward()
    assert seen[:2] == ["pre", "post"] and sorted(seen[2:]) == ["backward", "grad"]


def test_a_hook_registered_after_transform_sees_the_site_output():
    model = qtransform.transform(tiny_qwen2(), W4)
    q = model.model.layers[0].self_attn.q_proj
    captured = {}
    q.register_forward_hook(lambda m, a, o: captured.setdefault("out", o))
    x = torch.randn(2, 64)
    y = q(x)
    assert torch.equal(captured["out"], y)


def test_writes_to_the_parameter_slot_are_what_the_graph_reads():
    """The graph reads `self.weight` at call time: a new Parameter put in the slot is used."""
    model = qtransform.transform(tiny_qwen2(), W4)
    q = model.model.layers[0].self_attn.q_proj
    new = torch.randn_like(q.weight)
    q.weight = nn.Parameter(new)
    x = torch.randn(2, 64)
    assert torch.equal(q(x), x @ fake_quantize(new, "mxfp4", axis=-1).T)


def test_deepcopy_of_a_transformed_model_is_independent():
    model = qtransform.transform(tiny_qwen2(), W4)
    twin = copy.deepcopy(model)
    q, tq = model.model.layers[0].self_attn.q_proj, twin.model.layers[0].self_attn.q_proj
    assert tq.forward.state.module is tq
    with torch.no_grad():
        tq.weight.mul_(2)
    x = torch.randn(2, 64)
    assert torch.equal(q(x), x @ fake_quantize(q.weight.detach(), "mxfp4", axis=-1).T)
    assert torch.equal(tq(x), x @ fake_quantize(tq.weight.detach(), "mxfp4", axis=-1).T)


def test_transforming_a_transformed_model_is_refused():
    model = qtransform.transform(tiny_qwen2(), W4)
    with pytest.raises(qtransform.UserError, match="transformed already"):
        qtransform.transform(model, W4)


def test_peft_wraps_transformed_linears():
    peft = pytest.importorskip("peft")
    model = qtransform.transform(tiny_qwen2(), W4)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    wrapped = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(wrapped.base_layer, nn.Linear)
    x = torch.randn(2, 64)
    base = x @ fake_quantize(wrapped.base_layer.weight.detach(), "mxfp4", axis=-1).T
    torch.nn.init.normal_(wrapped.lora_B["default"].weight)  # a non-zero LoRA delta
    delta = wrapped.lora_B["default"](wrapped.lora_A["default"](x)) * wrapped.scaling["default"]
    torch.testing.assert_close(wrapped(x), base + delta, rtol=0, atol=1e-6)


def test_export_and_graph_mode_still_see_the_fake_quant_nodes(tmp_path):
    model = qtransform.transform(tiny_qwen2(), W4)
    ids = torch.randint(0, 128, (1, 8))
    ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)
    nodes = [n for n in ep.graph.nodes if n.op == "call_function" and "fake_quant" in str(n.target)]
    assert len(nodes) == 14  # 7 linears per layer, 2 layers, lm_head ignored
    assert len(qtransform.insertion_log(model)) == 14


@pytest.mark.parametrize("write", ["data_copy", "data_add", "no_grad_copy", "swap_rows"])
def test_every_write_to_a_weight_is_seen_by_the_next_forward(write):
    model = qtransform.transform(tiny_qwen2(), W4)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    q(x)  # fills the cache
    new = torch.randn_like(q.weight)
    if write == "data_copy":
        q.weight.data.copy_(new)
    elif write == "data_add":
        q.weight.data += new
        new = q.weight.detach().clone()
    elif write == "no_grad_copy":
        with torch.no_grad():
            q.weight.copy_(new)
    else:  # same values, other places: a sum would not see it
        new = q.weight.detach().flip(0).clone()
        q.weight.data.copy_(new)
    assert torch.equal(q(x), x @ fake_quantize(new, "mxfp4", axis=-1).T)


def test_peft_merge_and_unload_gives_the_fake_quantized_merged_weight():
    peft = pytest.importorskip("peft")
    model = qtransform.transform(tiny_qwen2(), W4)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(2, 64)
    layer(x)  # the base weight is cached now
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    merged_w = (layer.base_layer.weight + delta).detach()
    merged = lora.merge_and_unload()
    q = merged.model.layers[0].self_attn.q_proj
    assert type(q) is nn.Linear
    torch.testing.assert_close(q.weight.detach(), merged_w, rtol=0, atol=1e-6)
    assert torch.equal(q(x), x @ fake_quantize(q.weight.detach(), "mxfp4", axis=-1).T)


def lora_model(targets="all-linear"):
    peft = pytest.importorskip("peft")
    model = tiny_qwen2()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # a non-zero delta, so a quantized adapter would show
    return lora


def test_peft_first_then_transform_quantizes_bases_and_never_adapters():
    lora = lora_model()
    out = qtransform.transform(lora, W4)
    quantized = {i.site for i in qtransform.insertion_log(out)}
    assert quantized and all(s.endswith(".base_layer") for s in quantized)
    assert len(quantized) == 14
    layer = out.base_model.model.model.layers[1].mlp.up_proj
    x = torch.randn(2, 64)
    base = x @ fake_quantize(layer.base_layer.weight.detach(), "mxfp4", axis=-1).T
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = base + (x @ a.T @ b.T) * layer.scaling["default"]  # the adapter in full precision
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)


def test_selectors_use_the_names_users_write_under_peft():
    lora = lora_model(["q_proj", "v_proj"])
    plan = qtransform.plan(lora, {"version": 1, "quantize": [
        {"targets": ["q_proj"], "format": "nvfp4"},
        {"targets": ["lora_A"], "format": "mxfp8_e4m3"}]})
    chosen = {r.site: r.rule for r in plan.rows}
    assert set(chosen) == {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in (0, 1)
                           for p in ("q_proj.base_layer", "q_proj.lora_A.default", "v_proj.lora_A.default")}
    roles = {s.name: s.role for s in plan.sites}
    assert roles["base_model.model.model.layers.0.self_attn.q_proj.base_layer"] == "q"
    with pytest.raises(qtransform.UserError, match="lora_Z"):
        qtransform.plan(lora, {"version": 1, "quantize": [{"targets": ["lora_Z"], "format": "nvfp4"}]})


def test_gradients_reach_lora_parameters_and_not_the_frozen_base():
    out = qtransform.transform(lora_model(), W4)
    out.train()
    ids = torch.randint(0, 128, (2, 6))
    out(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in out.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_" in n)
    assert all(g is None for n, g in grads.items() if "lora_" not in n)


def test_a_graph_mode_result_exports_and_matches_pytorch(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    ids = torch.randint(0, 128, (1, 8))
    model = qtransform.transform(tiny_qwen2(), W4, {"input_ids": ids}, mode="graph")
    assert len([i for i in qtransform.insertion_log(model) if i.pass_name == "fake_quant"]) == 14
    path = qtransform.export_onnx(model, tmp_path / "g.onnx", {"input_ids": ids}, dynamic=False)
    sess = ort.InferenceSession(str(path))
    onnx_logits = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        torch_logits = model(input_ids=ids, use_cache=False)["logits"]
    torch.testing.assert_close(torch.from_numpy(onnx_logits), torch_logits, rtol=1e-4, atol=1e-4)


def test_a_pickled_transformed_model_loads_with_its_graphs(tmp_path):
    import io

    model = qtransform.transform(tiny_qwen2(), W4)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    q = again.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64)
    assert torch.equal(q(x), x @ fake_quantize(q.weight.detach(), "mxfp4", axis=-1).T)


def test_save_and_load_transformed_round_trip_a_peft_model(tmp_path):
    lora = lora_model(["q_proj", "up_proj"])
    out = qtransform.transform(lora, W4)
    qtransform.save_transformed(out, W4, tmp_path / "saved")
    again = qtransform.load_transformed(tmp_path / "saved")
    ids = torch.randint(0, 128, (2, 6))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, out(input_ids=ids).logits)
    assert {i.site for i in qtransform.insertion_log(again)} == {i.site for i in qtransform.insertion_log(out)}
    base = Qwen2ForCausalLM.from_pretrained(tmp_path / "saved")  # plain transformers reads the base
    torch.testing.assert_close(base.model.layers[0].self_attn.q_proj.weight,
                               out.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight)
