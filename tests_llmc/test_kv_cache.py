"""llm-compressor's kv_cache_scheme against the KV presets: the same tiny model and calibration
samples, logits equal bit for bit (keys and values after RoPE, static FP8 scales from its K/V
observer, per tensor or per head, in float32 and bfloat16)."""

from __future__ import annotations

import copy

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests_llmc.oneshot import llm_compressor_model
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
