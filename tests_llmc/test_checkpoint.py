"""qtransform's checkpoints against llm-compressor's own: for every preset scheme the tensors of
`export_checkpoint` are byte-identical to what `save_compressed` writes for the same model, and
transformers (with compressed-tensors) loads the export into the fake-quant model's logits
(docs/export.md)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

import qtransform
from qtransform.models import build_tiny
from tests_llmc.oneshot import llm_compressor_model
from tests_llmc.test_presets import HIDDEN, SCHEMES, samples

CASES = [(arch, scheme, dtype) for dtype in (torch.float32, torch.bfloat16)
         for arch in ("qwen2", "llama") for scheme in SCHEMES]


def tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(("arch", "scheme", "dtype"), [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{str(case[2]).removeprefix('torch.')}")
    for case in CASES])
def test_export_is_byte_identical_to_save_compressed(arch, scheme, dtype, tmp_path):
    model = build_tiny(arch, hidden=HIDDEN, dtype=dtype)
    batches, _ = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, scheme, batches, tmp_path / "cfg")
    theirs.save_pretrained(tmp_path / "theirs", save_compressed=True)
    ours = qtransform.transform(copy.deepcopy(model), {"preset": f"llm-compressor/{scheme}"},
                                calibration=batches)
    qtransform.export_checkpoint(ours, tmp_path / "ours")

    expected, got = tensors(tmp_path / "theirs"), tensors(tmp_path / "ours")
    assert sorted(got) == sorted(expected)
    quantized = [k for k in expected if not k.endswith((".bias", "norm.weight"))
                 and "embed" not in k and not k.startswith("lm_head")]
    assert any(k.endswith(("weight_packed", "weight_scale")) for k in quantized)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].shape == expected[name].shape, name
        assert torch.equal(raw(got[name]), raw(expected[name])), name

    def qconfig(folder):
        return json.loads((folder / "config.json").read_text())["quantization_config"]

    assert qconfig(tmp_path / "ours") == qconfig(tmp_path / "theirs")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_the_export_into_the_fake_quant_logits(scheme, tmp_path):
    from transformers import AutoModelForCausalLM

    # the model as a user loads it in bf16 (transformers keeps rotary inv_freq in fp32)
    build_tiny("qwen2", hidden=HIDDEN).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16).eval()
    batches, ids = samples(model.config.vocab_size)
    ours = qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}, calibration=batches)
    qtransform.export_checkpoint(ours, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected, got = ours(ids).logits, loaded(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16)(ids).logits
    assert not torch.equal(expected, plain)  # the scheme changed something
    assert torch.equal(got, expected), f"max |diff| {(got - expected).float().abs().max().item():.3g}"
