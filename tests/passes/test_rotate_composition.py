"""Rotations composed with the rest of qtransform: ONNX, PEFT LoRA and
rollout weights, noise, plans and explanations, saving. References are built here: a dense R
(scipy's Hadamard matrix) applied by hand, onnxruntime, plain transformers models."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from qtransform.passes import Rotate
from qtransform.schemas import load_policy
from qtransform.schemas.explain import explain
from tests.passes.test_rotate_pass import IDS, block_diag, dense_rotation, linear_names, logits
from tests.tiny_rl import tiny_qwen2

ROT = {"targets": ["Linear"], "ignore": ["lm_head"], "kind": "random_hadamard", "block_size": 32, "seed": 9}
W4A4 = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight", "input"]}


def _rotated_values(model) -> dict[str, torch.Tensor]:
    """The eager output of every Rotate module in one forward, by label."""
    seen: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.__setitem__(mod.label, out.detach().clone()))
             for m in model.modules() if isinstance(m, Rotate)]
    logits(model)
    for h in hooks:
        h.remove()
    return seen


def _run_exposing_rotations(path) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """onnxruntime's graph outputs, and each Rotate node's (input, output) by node name."""
    import onnx

    proto = onnx.load(str(path))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type == "Rotate" and n.domain == "qtransform"]
    have = {o.name for o in proto.graph.output}
    for value in {v for n in nodes for v in (n.input[0], n.output[0])} - have - set(inits):
        proto.graph.output.append(onnx.helper.make_tensor_value_info(value, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(proto.SerializeToString())
    names = [o.name for o in session.get_outputs()]
    values = dict(zip(names, session.run(None, {"input_ids": IDS.numpy()}), strict=True))
    values.update(inits)
    return values, {n.name: (values[n.input[0]], values[n.output[0]]) for n in nodes}


@pytest.mark.parametrize("kind", ["hadamard", "random_hadamard"])
def test_onnx_rotation_nodes_are_named_and_bit_exact_in_onnxruntime(tmp_path, kind):
    rule = {**ROT, "kind": kind, **({"seed": 9} if kind == "random_hadamard" else {"seed": 0})}
    pol = {"version": 1, "rotate": [rule], "quantize": [W4A4]}
    model = qtransform.transform(build_tiny("qwen2"), pol)
    path = qtransform.export_onnx(model, tmp_path / "m.onnx", {"input_ids": IDS})
    import onnx

    proto = onnx.load(str(path))
    want = {f"{s}/{p}_rotate" for s in linear_names(model) for p in ("weight", "input")}
    assert {n.name for n in proto.graph.node if n.op_type == "Rotate" and n.domain == "qtransform"} == want
    assert {(f.name, f.overload) for f in proto.functions if f.name == "Rotate"} == {("Rotate", f"{kind}_32")}
    _, rotations = _run_exposing_rotations(path)
    assert set(rotations) == want
    for label, (given, got) in rotations.items():  # PyTorch's module on onnxruntime's input
        site, point = label.rsplit("/", 1)
        module = model.get_submodule(site).get_submodule(point)
        expect = module.rotate_weight(torch.from_numpy(given.copy()))
        assert np.array_equal(got, expect.numpy()), label


def test_onnx_rotations_of_a_moe_model_and_its_experts_are_bit_exact(tmp_path):
    model = qtransform.transform(build_tiny("qwen2_moe"), {"version": 1, "rotate": [ROT]})
    _, rotations = _run_exposing_rotations(qtransform.export_onnx(model, tmp_path / "m.onnx", {"input_ids": IDS}))
    labels = {f"{s}/{p}_rotate" for s in linear_names(model) for p in ("weight", "input")}
    assert labels <= set(rotations)
    assert "model.layers.0.mlp.experts.gate_up_proj/weight_rotate" in rotations
    for label, (given, got) in rotations.items():
        site, point = label.rsplit("/", 1)
        owner = model.get_submodule(site.rsplit(".", 1)[0]) if ".experts." in site else model.get_submodule(site)
        name = f"{site.rsplit('.', 1)[1]}__{point}" if ".experts." in site else point
        expect = owner.get_submodule(name).rotate_weight(torch.from_numpy(given.copy()))
        assert np.array_equal(got, expect.numpy()), label


def test_a_matrix_rotation_exports_as_a_matmul_equal_to_rounding(tmp_path):
    q, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))
    torch.save(q.float(), tmp_path / "r.pt")
    pol = {"version": 1, "rotate": [{"targets": ["mlp.up_proj"], "kind": "matrix", "matrix": str(tmp_path / "r.pt")}],
           "instrument": {"points": ["input"]}}
    model = qtransform.transform(build_tiny("qwen2"), pol)
    session = ort.InferenceSession(str(qtransform.export_onnx(model, tmp_path / "m.onnx", {"input_ids": IDS})))
    outputs = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {"input_ids": IDS.numpy()}), strict=True))
    eager = _rotated_values(model)["model.layers.0.mlp.up_proj/input_rotate"]
    np.testing.assert_allclose(outputs["tap:model.layers.0.mlp.up_proj:input"], eager.numpy(), rtol=0, atol=2e-6)


peft = pytest.importorskip("peft")
LORA_IDS = torch.tensor([[5, 17, 33, 8, 90, 2, 61], [3, 44, 21, 100, 7, 12, 9]])


def _lora_model(order: str, pol: dict) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    if order == "transform_first":
        model = peft.get_peft_model(qtransform.transform(tiny_qwen2(), pol), config)
    else:
        model = qtransform.transform(peft.get_peft_model(tiny_qwen2(), config), pol)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("lora", ["unrotated", "rotated"])
@pytest.mark.parametrize("order", ["transform_first", "peft_first"])
def test_lora_adapters_see_the_input_the_rule_says_and_rollouts_are_the_same_model(order, lora):
    pol = {"version": 1, "rotate": [{**ROT, "lora": lora}],
           "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}
    model = _lora_model(order, pol)
    layer = model.base_model.model.model.layers[0].mlp.down_proj  # the LoRA layer
    seen: dict[str, torch.Tensor] = {}
    layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    layer.lora_A["default"].register_forward_hook(lambda m, a, out: seen.__setitem__("a", a[0].detach().clone()))
    with torch.no_grad():
        trainer = model(LORA_IDS).logits  # PEFT's own forward: base(x) + s B A (x or x·R)
    r = block_diag(dense_rotation(32, "random_hadamard", 9), 128)
    want = seen["x"] if lora == "unrotated" else (seen["x"].double() @ r).float()
    torch.testing.assert_close(seen["a"], want, rtol=0, atol=2e-6)
    with torch.no_grad(), qtransform.rollout():
        rollout = model(LORA_IDS).logits  # the dense weight: quant(W·R) + (s B A)·R or + s B A
    torch.testing.assert_close(trainer, rollout, rtol=0, atol=2e-5)
    # an engine loaded with the rollout weights rotates each rotated Linear's input online
    engine = tiny_qwen2()
    engine.load_state_dict(dict(qtransform.rollout_weights(model)))
    for name in linear_names(engine):
        big = block_diag(dense_rotation(32, "random_hadamard", 9), engine.get_submodule(name).in_features)
        engine.get_submodule(name).register_forward_pre_hook(
            lambda m, a, big=big: ((a[0].double() @ big).float(),))
    with torch.no_grad():
        torch.testing.assert_close(engine(LORA_IDS).logits, rollout, rtol=0, atol=2e-5)


def test_rollout_weights_of_a_rotated_site_are_the_rotated_quantized_weight():
    pol = {"version": 1, "rotate": [ROT], "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}
    model = qtransform.transform(build_tiny("qwen2"), pol)
    sent = dict(qtransform.rollout_weights(model))
    site = model.model.layers[1].self_attn.o_proj
    assert torch.equal(sent["model.layers.1.self_attn.o_proj.weight"],
                       site.weight_fake_quant(site.weight_rotate(site.weight)))
    assert torch.equal(sent["lm_head.weight"], model.lm_head.weight)


@pytest.mark.parametrize("extra", [
    {"hw_error": {"targets": ["Linear"], "ignore": ["lm_head"], "error_scale": 0.05, "seed": 4}},
    {"noise": {"targets": ["RMSNorm"], "seed": 3, "apply_during": "both",
               "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 4, "total_steps": 8}}},
], ids=["hw_error", "aqn"])
def test_noise_draws_are_the_same_with_and_without_a_rotation(extra):
    """Hardware error (site outputs) and AQN (norm weights) draw per site and step; a rotation,
    which leaves full-precision outputs unchanged, leaves the noisy model unchanged to rounding."""
    base = build_tiny("qwen2")
    noisy = qtransform.transform(base, {"version": 1, **extra})
    both = qtransform.transform(base, {"version": 1, "rotate": [ROT], **extra})
    for m in (noisy, both):
        qtransform.noise_controller(m).set_step(5)
    a, b = logits(noisy), logits(both)
    assert not torch.equal(a, logits(base))  # the noise is on
    torch.testing.assert_close(b, a, rtol=0, atol=2e-6 * float(a.abs().max()))


def test_plan_and_explain_list_the_rotations(tmp_path):
    pol = {"version": 1, "rotate": [{**ROT, "name": "h32"}], "quantize": [W4A4]}
    text = explain(load_policy(pol))
    assert "random Hadamard rotation (seed 9)" in text and "32-wide" in text
    assert "before any fake quantization" in text
    path = tmp_path / "p.json"
    path.write_text(json.dumps(pol))
    res = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", "builtin:qwen2", str(path), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    sites = {s["name"]: s for s in json.loads(res.stdout)["sites"]}
    actions = sites["model.layers.0.mlp.down_proj"]["actions"]
    assert [(a["pass_name"], a["point"]) for a in actions][:2] == [("rotate", "weight"), ("rotate", "input")]
    assert actions[0]["detail"] == "random_hadamard block=32, seed=9"
    assert actions[0]["rule"] == "rotate[0] 'h32'"


def test_a_saved_rotated_model_reloads_with_its_rotations(tmp_path):
    pol = {"version": 1, "rotate": [ROT], "quantize": [W4A4]}
    model = qtransform.transform(build_tiny("qwen2"), pol)
    assert not any("rotate" in k for k in model.state_dict())  # nothing persistent inserted
    qtransform.save_transformed(model, pol, tmp_path / "out")
    again = qtransform.load_transformed(tmp_path / "out")
    assert torch.equal(logits(again), logits(model))


@pytest.mark.parametrize("mode", ["inline", "qdq"])
def test_rotations_export_in_the_inline_and_qdq_encodings(tmp_path, mode):
    import onnx

    pol = {"version": 1, "rotate": [ROT],
           "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "int8", "block_size": 32}]}
    model = qtransform.transform(build_tiny("qwen2"), pol)
    path = qtransform.export_onnx(model, tmp_path / "m.onnx", {"input_ids": IDS}, fake_quant=mode)
    proto = onnx.load(str(path))
    rotate_fns = [f for f in proto.functions if f.name == "Rotate"]
    assert (not rotate_fns) if mode == "inline" else bool(rotate_fns)
    out = ort.InferenceSession(str(path)).run(None, {"input_ids": IDS.numpy()})[0]
    np.testing.assert_allclose(out, logits(model).numpy(), rtol=0, atol=1e-5)


def test_a_bf16_model_rotates_in_fp32_and_keeps_its_outputs():
    model = build_tiny("llama", dtype=torch.bfloat16)
    out = logits(qtransform.transform(model, {"version": 1, "rotate": [ROT]})).float()
    want = logits(model).float()
    assert (out - want).abs().max() <= 0.05 * want.abs().max()  # bf16 rounding of x·R and W·R
    site = qtransform.transform(model, {"version": 1, "rotate": [ROT]}).model.layers[0].mlp.up_proj
    rotated = site.weight_rotate(site.weight)
    assert rotated.dtype == torch.bfloat16
    r = block_diag(dense_rotation(32, "random_hadamard", 9), 64)
    exact = site.weight.double() @ r
    # rounded once to bf16 (8 significant bits): within half a bf16 step of the exact product
    assert ((rotated.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-30).all()


def test_the_cli_reports_a_misfit_block_in_one_line_with_exit_2(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"version": 1, "rotate": [{"targets": ["Linear"], "block_size": 128}]}))
    res = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", "builtin:qwen2", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "rotate[0].block_size: 128 does not divide the 64 input features" in res.stderr
    assert "block sizes that fit: 2, 4, 8, 16, 32, 64" in res.stderr
