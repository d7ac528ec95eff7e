"""The llm-compressor presets compute what llm-compressor computes: logits equal to the plain-torch
model of it in tests/llmc_reference.py (itself checked equal to llm-compressor in tests_llmc/)."""

from __future__ import annotations

import copy

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests.helpers import assert_untouched, snapshot
from tests.llmc_reference import SCHEMES, reference_model

CASES = [("qwen2", s, torch.float32) for s in SCHEMES]
CASES += [("llama", s, torch.float32) for s in ("NVFP4", "FP8", "W4A16")]
CASES += [("qwen2", s, torch.bfloat16) for s in ("FP8", "FP8_DYNAMIC", "W8A8", "NVFP4", "NVFP4A16")]


def samples(vocab: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(3)], \
        torch.randint(0, vocab, (2, 12), generator=g)


@pytest.mark.parametrize(("arch", "scheme", "dtype"), [
    *(pytest.param(*case, id=f"{case[0]}-{case[1]}-{str(case[2]).removeprefix('torch.')}")
      for case in CASES)])
def test_preset_equals_llm_compressor_model(arch, scheme, dtype):
    model = build_tiny(arch, hidden=128, dtype=dtype)  # llm-compressor's 128-wide groups need 128
    batches, ids = samples(model.config.vocab_size)
    before = snapshot(model)
    ours = qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}, calibration=batches)
    assert_untouched(before, model)
    expected = reference_model(model, scheme, batches)
    with torch.no_grad():
        got, want = ours(ids).logits, expected(ids).logits
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3g}"


def test_a_sequence_does_not_depend_on_its_batch():
    """Every llm-compressor scheme is batch-invariant; the static NVFP4 preset keeps that."""
    model = build_tiny("qwen2", hidden=128)
    batches, ids = samples(model.config.vocab_size)
    ours = qtransform.transform(copy.deepcopy(model), {"preset": "llm-compressor/NVFP4"},
                                calibration=batches)
    with torch.no_grad():
        alone = ours(ids[:1]).logits
        together = ours(torch.cat([ids[:1], ids[1:] * 0 + 7])).logits[:1]
    assert torch.equal(alone, together)


def test_qerl_is_the_nvfp4a16_model_with_noise_in_rollouts_only():
    model = build_tiny("qwen2", hidden=128)
    _, ids = samples(model.config.vocab_size)
    base = qtransform.transform(model, {"preset": "llm-compressor/NVFP4A16"})
    qerl = qtransform.transform(model, {"preset": "qerl", "noise": {"schedule": {"total_steps": 20}}})
    noise = qtransform.noise_controller(qerl)
    for _ in range(5):
        noise.step()  # past the noise-free first stage
    with torch.no_grad():
        clean, plain = qerl(ids).logits, base(ids).logits
        with qtransform.rollout():
            rolled = qerl(ids).logits
    assert torch.equal(clean, plain)  # the loss and the log-probs see the clean NVFP4A16 model
    assert not torch.equal(rolled, plain)  # the rollout samples from the noised norms
