"""Four-over-six NVFP4 weights in checkpoints: the choice lives in the E4M3 block scale, so a
ModelOpt checkpoint (decode q * (s * d)) stores them as ordinary NVFP4. The written bytes equal an
independent packer (tests/formats/stack_fouroversix.py) applied to each order's own choice,
ported from its stack, and the folder opens back to the same logits bit for bit; compressed-tensors
(decode q * (s / g)) refuses them in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import qtransform
from qtransform.models import build_tiny, checkpoint_policy, load_model
from tests.export.test_checkpoint import read
from tests.formats import stack_fouroversix as port

F32 = np.float32
FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
         "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
         "up_proj": ("gate_proj", "up_proj")}
ORDERS = [("pairwise", "mse", "448"), ("pairwise", "mae", "256"), ("transformer-engine", "mse", "256"),
          ("flashinfer", "mae", "448"), ("fouroversix", "mse", "256")]


def weight_rule(order: str, mode: str, bound: str) -> dict:
    return {"targets": ["Linear"], "ignore": ["lm_head"], "tensors": ["weight"], "format": "nvfp4",
            "four_over_six": mode, "four_over_six_order": order, "global_bound": int(bound),
            "share_scale": "fused"}


def chosen_scales(order: str, blocks: np.ndarray, amax_t: np.float32, bound: int, mode: str) -> list[float]:
    """Each block's E4M3 scale as the order's stack chooses it (the numpy ports)."""
    if order == "fouroversix":
        return port.fouroversix(blocks, amax_t, mode)[1].tolist()
    if order == "flashinfer":
        g = port._enc(amax_t, bound)
        return [port.flashinfer(b, g, mode)[1] for b in blocks]
    fn = port.transformer_engine if order == "transformer-engine" else port.pairwise
    return [fn(b, amax_t, bound, mode)[1] for b in blocks]


@pytest.mark.parametrize(("order", "mode", "bound"), ORDERS, ids=[f"{o}-{m}-{b}" for o, m, b in ORDERS])
def test_modelopt_bytes_are_the_stacks_choice_packed(order, mode, bound, tmp_path):
    model = build_tiny("qwen2")
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    transformed = qtransform.transform(model, {"quantize": [weight_rule(order, mode, bound)]})
    tensors = read(qtransform.export_checkpoint(transformed, tmp_path / "out", format="modelopt"))
    four = 0
    for name in [n for n in weights if n.startswith("model.layers.0.")]:
        parent, _, leaf = name.rpartition(".")
        amax_t = F32(max(weights[f"{parent}.{s}"].abs().max().item() for s in FUSED.get(leaf, (leaf,))))
        d = F32(1) / port._enc(amax_t, int(bound))
        w = weights[name].numpy()
        blocks = w.reshape(-1, 16)
        scales = chosen_scales(order, blocks, amax_t, int(bound), mode)
        values = torch.tensor([port.elements(b, s, d) for b, s in zip(blocks, scales, strict=True)])
        assert torch.equal(tensors[f"{name}.weight"], port.packed_nvfp4(values.reshape(w.shape))), name
        want = torch.tensor(scales, dtype=torch.float32).to(torch.float8_e4m3fn).reshape(w.shape[0], -1)
        assert torch.equal(tensors[f"{name}.weight_scale"].view(torch.uint8), want.view(torch.uint8)), name
        assert tensors[f"{name}.weight_scale_2"].item() == float(d), name
        six = torch.tensor([port.e4m3(np.abs(b).max() / F32(6) * port._enc(amax_t, int(bound))) for b in blocks])
        four += int((torch.tensor(scales) > six).sum())
    assert four > 0  # some blocks keep max/4 (their scale is above the plain max/6 one)


def test_a_four_over_six_checkpoint_opens_to_the_same_logits(tmp_path):
    """W4A4 as ModelOpt deploys it (the NVFP4_DEFAULT_CFG preset with four-over-six weights):
    the opened folder holds the fake-quantized weights, and checkpoint_policy's model gives the
    transformed model's logits bit for bit (bf16)."""
    folder = tmp_path / "base"
    build_tiny("qwen2", hidden=128, dtype=torch.bfloat16).save_pretrained(folder)
    base = load_model(folder)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, base.config.vocab_size, (1, 16), generator=g) for _ in range(4)]
    ids = torch.randint(0, base.config.vocab_size, (3, 12), generator=g)
    policy = {"preset": "modelopt/NVFP4_DEFAULT_CFG",
              "quantize": [{"name": "modelopt/NVFP4_DEFAULT_CFG weights", "nvfp4_variant": "default",
                            "four_over_six": "mse", "global_bound": 256}]}
    transformed = qtransform.transform(base, policy, calibration=batches)
    opened = load_model(qtransform.export_checkpoint(transformed, tmp_path / "ckpt", format="modelopt"))
    state = opened.state_dict()
    with torch.no_grad():
        for name, module in transformed.named_modules():
            fq = getattr(module, "weight_fake_quant", None)
            if fq is not None:
                assert torch.equal(state[f"{name}.weight"], fq(module.weight)), name
        expected = transformed(ids).logits
        got = qtransform.transform(opened, checkpoint_policy(opened))(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"


def test_compressed_tensors_refuses_four_over_six_naming_modelopt(tmp_path):
    model = qtransform.transform(build_tiny("qwen2"), {"quantize": [weight_rule("pairwise", "mse", "448")]})
    with pytest.raises(qtransform.UserError, match=r"four_over_six .*format='modelopt'"):
        qtransform.export_checkpoint(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_modelopt_four_over_six_preset_weights_bytes_and_reopening_are_the_port(tmp_path):
    """modelopt/NVFP4_FOUR_OVER_SIX_CFG: the transformed weights are ModelOpt's export's values
    (the numpy port of its MSE calibration and export, G the fused group's amax), the checkpoint's
    bytes are that export packed, hf_quant_config says NVFP4 (ModelOpt writes the static 4/6
    quantizers as "nvfp4_static" -> NVFP4), and the folder opens back to the same logits (bf16)."""
    folder = tmp_path / "base"
    build_tiny("qwen2", hidden=128, dtype=torch.bfloat16).save_pretrained(folder)
    base = load_model(folder)
    weights = {n: m.weight.detach().float().clone() for n, m in base.named_modules()
               if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, base.config.vocab_size, (1, 16), generator=g) for _ in range(4)]
    ids = torch.randint(0, base.config.vocab_size, (3, 12), generator=g)
    transformed = qtransform.transform(base, {"preset": "modelopt/NVFP4_FOUR_OVER_SIX_CFG"}, calibration=batches)
    out = qtransform.export_checkpoint(transformed, tmp_path / "ckpt", format="modelopt")
    tensors = read(out)
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    modules = dict(transformed.named_modules())
    four = 0
    for name in [n for n in weights if n.startswith("model.layers.0.")]:
        parent, _, leaf = name.rpartition(".")
        amax_t = F32(max(weights[f"{parent}.{s}"].abs().max().item() for s in FUSED.get(leaf, (leaf,))))
        w = weights[name].numpy()
        found = [port.modelopt_four_over_six(b, amax_t) for b in w.reshape(-1, 16)]
        d = found[0][3]
        values = torch.tensor([f[1] for f in found]).reshape(w.shape)
        scales = torch.tensor([f[2] for f in found], dtype=torch.float32)
        served = (values * (scales[:, None] * torch.tensor(d)).reshape(w.shape[0], -1).repeat_interleave(16, 1)) + 0.0
        with torch.no_grad():
            got = modules[name].weight_fake_quant(modules[name].weight)
        assert torch.equal(got, served.to(got.dtype)), name  # the model's dtype: bf16
        assert torch.equal(tensors[f"{name}.weight"], port.packed_nvfp4(values)), name
        want = scales.to(torch.float8_e4m3fn).reshape(w.shape[0], -1)
        assert torch.equal(tensors[f"{name}.weight_scale"].view(torch.uint8), want.view(torch.uint8)), name
        assert tensors[f"{name}.weight_scale_2"].item() == float(d), name
        four += sum(f[0] for f in found)
    assert four > 0
    opened = load_model(out)
    with torch.no_grad():
        expected = transformed(ids).logits
        got = qtransform.transform(opened, checkpoint_policy(opened))(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"
