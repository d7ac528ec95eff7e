"""Re-opening an export (the reading half of the checkpoints): a model transformed with each
preset, exported with `export_checkpoint` and opened again with `load_model`, holds the
fake-quantized weights bit for bit, and transforming it with `checkpoint_policy` gives the
transformed model's logits bit for bit (bf16, the dtype compressed-tensors loads)."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.models import build_tiny, checkpoint_policy, load_model

CASES = [("compressed-tensors", f"llm-compressor/{s}") for s in
         ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W8A8")]
CASES += [("modelopt", "modelopt/NVFP4_DEFAULT_CFG"), ("modelopt", "modelopt/FP8_DEFAULT_CFG")]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A bf16 tiny Qwen2 as load_model gives it (so the opened export differs by its weights only)."""
    folder = tmp_path_factory.mktemp("base")
    build_tiny("qwen2", hidden=128, dtype=torch.bfloat16).save_pretrained(folder)
    return load_model(folder)


@pytest.mark.parametrize(("fmt", "preset"), CASES, ids=[p for _, p in CASES])
def test_an_export_opens_as_the_model_it_was(base, fmt, preset, tmp_path):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, base.config.vocab_size, (1, 16), generator=g) for _ in range(4)]
    ids = torch.randint(0, base.config.vocab_size, (3, 12), generator=g)
    transformed = qtransform.transform(base, {"preset": preset}, calibration=batches)
    folder = qtransform.export_checkpoint(transformed, tmp_path / "ckpt", format=fmt)

    opened = load_model(folder)
    state = opened.state_dict()
    for name, module in transformed.named_modules():
        fq = getattr(module, "weight_fake_quant", None)
        if fq is not None:
            with torch.no_grad():
                assert torch.equal(state[f"{name}.weight"], fq(module.weight)), name
    with torch.no_grad():
        expected = transformed(ids).logits
        got = qtransform.transform(opened, checkpoint_policy(opened))(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"
    # the whole scheme (weights=True) on the full-precision model is the producer's recipe again
    recipe = checkpoint_policy(opened, weights=True)
    assert [r["tensors"] for r in recipe["quantize"]][0] == ["weight"]
    with torch.no_grad():
        again = qtransform.transform(base, recipe, calibration=batches)(ids).logits
    assert torch.equal(again, expected), f"max |diff| {(again - expected).abs().max().item():.3g}"


def test_a_reexport_keeps_the_stored_input_scales(base, tmp_path):
    """The opened checkpoint's input scales are stored numbers, written again as they are: a g of
    2144 (bf16 of 2688 / 1.2578125, as llm-compressor stores a bf16 model's) stays 2144, where an
    amax made of it (2688 / 2144) would give this bf16 model g = 2160."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, base.config.vocab_size, (1, 16), generator=g) for _ in range(2)]
    transformed = qtransform.transform(base, {"preset": "llm-compressor/NVFP4"}, calibration=batches)
    folder = qtransform.export_checkpoint(transformed, tmp_path / "a")
    [file] = folder.glob("*.safetensors")
    tensors = load_file(file)
    key = "model.layers.0.self_attn.q_proj.input_global_scale"
    tensors[key] = torch.tensor([2144.0])
    save_file(tensors, file, metadata={"format": "pt"})
    opened = load_model(folder)
    again = qtransform.transform(opened, checkpoint_policy(opened, weights=True))
    out = qtransform.export_checkpoint(again, tmp_path / "b")
    written = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert written[key].item() == 2144.0
    assert all(torch.equal(written[k], v) for k, v in tensors.items() if k.endswith("input_global_scale"))
