"""llm-compressor's kv_cache_scheme against the KV presets: the same tiny model and calibration
samples, logits equal bit for bit (keys and values after RoPE, static FP8 scales from its K/V
observer, per tensor or per head, in float32 and bfloat16)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests_llmc.oneshot import llm_compressor_model
from tests_llmc.test_checkpoint import raw, tensors
from tests_llmc.test_presets import HIDDEN, samples

KV = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
CASES = [(arch, strategy, dtype) for arch in ("qwen2", "llama") for strategy in ("tensor", "attn_head")
         for dtype in (torch.float32, torch.bfloat16)]
PRESETS = {"tensor": "llm-compressor/KV_FP8", "attn_head": "llm-compressor/KV_FP8_ATTN_HEAD"}


@pytest.mark.parametrize(("arch", "strategy", "dtype"), [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{str(case[2]).removeprefix('torch.')}") for case in CASES])
def test_kv_presets_equal_llm_compressor_logits(arch, strategy, dtype, tmp_path):
    model = build_tiny(arch, hidden=HIDDEN, dtype=dtype)
    batches, ids = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, "FP8_DYNAMIC", batches, tmp_path,
                                  kv_cache_scheme={**KV, "strategy": strategy})
    weights_only = qtransform.transform(copy.deepcopy(model), {"preset": "llm-compressor/FP8_DYNAMIC"})
    ours = qtransform.transform(copy.deepcopy(model), {
        "preset": ["llm-compressor/FP8_DYNAMIC", PRESETS[strategy]]}, calibration=batches)
    with torch.no_grad():
        expected, got, without = theirs(ids).logits, ours(ids).logits, weights_only(ids).logits
    assert not torch.equal(expected, without)  # the KV cache changed something
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"


@pytest.mark.parametrize(("strategy", "dtype"), [
    pytest.param(s, d, id=f"{s}-{str(d).removeprefix('torch.')}")
    for s in ("tensor", "attn_head") for d in (torch.float32, torch.bfloat16)])
def test_kv_export_is_byte_identical_to_save_compressed(strategy, dtype, tmp_path):
    model = build_tiny("qwen2", hidden=HIDDEN, dtype=dtype)
    batches, _ = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, "FP8_DYNAMIC", batches, tmp_path / "cfg",
                                  kv_cache_scheme={**KV, "strategy": strategy})
    theirs.save_pretrained(tmp_path / "theirs", save_compressed=True)
    ours = qtransform.transform(copy.deepcopy(model), {
        "preset": ["llm-compressor/FP8_DYNAMIC", PRESETS[strategy]]}, calibration=batches)
    qtransform.export_checkpoint(ours, tmp_path / "ours")
    expected, got = tensors(tmp_path / "theirs"), tensors(tmp_path / "ours")
    assert sorted(got) == sorted(expected)
    assert any(k.endswith(".self_attn.k_scale") for k in expected)
    for name in expected:
        assert (got[name].dtype, got[name].shape) == (expected[name].dtype, expected[name].shape), name
        assert torch.equal(raw(got[name]), raw(expected[name])), name

    def qconfig(folder):
        return json.loads((folder / "config.json").read_text())["quantization_config"]

    assert qconfig(tmp_path / "ours") == qconfig(tmp_path / "theirs")


def test_transformers_runs_the_kv_export_as_the_fake_quant_model(tmp_path):
    from transformers import AutoModelForCausalLM

    build_tiny("qwen2", hidden=HIDDEN).save_pretrained(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "source", dtype=torch.bfloat16).eval()
    batches, ids = samples(model.config.vocab_size)
    ours = qtransform.transform(model, {"preset": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"]},
                                calibration=batches)
    weights_only = qtransform.transform(model, {"preset": "llm-compressor/FP8_DYNAMIC"})
    qtransform.export_checkpoint(ours, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16).eval()
    opened = qtransform.models.load_model(tmp_path / "export", dtype=torch.bfloat16)
    reopened = qtransform.transform(opened, qtransform.checkpoint_policy(opened))
    with torch.no_grad():
        expected, got, again = ours(ids).logits, loaded(ids).logits, reopened(ids).logits
        without = weights_only(ids).logits
    assert not torch.equal(expected, without)  # the KV cache changed something
    assert torch.equal(got, expected), f"max |diff| {(got - expected).float().abs().max().item():.3g}"
    assert torch.equal(again, expected)
