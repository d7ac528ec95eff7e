"""The KV-cache presets run their key/value quantizers through the compiled per-tensor FP8
kernel (`fastpath.fp8_tensor`), and a model's logits, prefill and every decode step, are the
same bits as with the fast path switched off (QTRANSFORM_FASTPATH=0: the torch path)."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.formats import fastpath
from qtransform.models import build_tiny

pytestmark = pytest.mark.skipif(fastpath.unavailable_reason() is not None,
                                reason=f"no CPU kernel: {fastpath.unavailable_reason()}")

PRESETS = [
    {"preset": "vllm/kv_fp8_e4m3", "preset_options": {"backend": "cpu"}},
    {"preset": "vllm/kv_fp8_e5m2", "preset_options": {"backend": "cpu", "scales": "calibrated"}},
    {"preset": "vllm/kv_fp8_e4m3", "preset_options": {"backend": "flash-attn-3"}},  # query too
    {"preset": "llm-compressor/KV_FP8"},  # static per-tensor scale, RNE, the model's dtype
]
IDS = ["vllm-cpu", "vllm-cpu-e5m2-calibrated", "vllm-fa3", "llmc-KV_FP8"]


def batches() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return ([torch.randint(0, 256, (1, 16), generator=g) for _ in range(2)],
            torch.randint(0, 256, (1, 9), generator=g))


def run(model: torch.nn.Module, prompt: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The prefill's logits and the scores of 6 greedy decode steps (each through the cache)."""
    with torch.no_grad():
        logits = model(prompt).logits
        out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return logits, list(out.scores)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", PRESETS, ids=IDS)
def test_logits_are_the_same_bits_with_and_without_the_fast_path(policy, dtype, monkeypatch):
    model = build_tiny("llama", hidden=128, dtype=dtype)
    calib, prompt = batches()
    transformed = qtransform.transform(model, policy, calibration=calib)
    taken: list[bool] = []
    kernel = fastpath.fp8_tensor

    def counted(*args, **kwargs):
        res = kernel(*args, **kwargs)
        taken.append(res is not None)
        return res

    monkeypatch.setattr(fastpath, "fp8_tensor", counted)
    fast_logits, fast_scores = run(transformed, prompt)
    layers = model.config.num_hidden_layers
    # key and value (and the query on GPU backends) of every layer in 7 forwards: the prefill,
    # then generate's own prefill and its 5 decode steps
    assert len(taken) >= 2 * layers * 7 and all(taken)
    with monkeypatch.context() as m:
        m.setenv("QTRANSFORM_FASTPATH", "0")
        ref_logits, ref_scores = run(transformed, prompt)
    assert not torch.equal(fast_logits, run(model, prompt)[0])  # the cache is quantized
    assert torch.equal(fast_logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref_logits.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert len(fast_scores) == len(ref_scores) == 6
    for a, b in zip(fast_scores, ref_scores, strict=True):
        assert torch.equal(a, b)
