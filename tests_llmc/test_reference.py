"""The main suite's model of llm-compressor (tests/llmc_reference.py) against llm-compressor itself:
the presets are tested against that model where llm-compressor is not installed."""

from __future__ import annotations

import pytest
import torch

from qtransform.models import build_tiny
from tests.llmc_reference import SCHEMES, reference_model
from tests_llmc.oneshot import llm_compressor_model
from tests_llmc.test_presets import HIDDEN, samples

CASES = [(arch, scheme, dtype) for dtype in (torch.float32, torch.bfloat16)
         for arch in ("qwen2", "llama") for scheme in SCHEMES]


@pytest.mark.parametrize(("arch", "scheme", "dtype"), CASES,
                         ids=[f"{a}-{s}-{str(d).removeprefix('torch.')}" for a, s, d in CASES])
def test_reference_equals_llm_compressor(arch, scheme, dtype, tmp_path):
    model = build_tiny(arch, hidden=HIDDEN, dtype=dtype)
    batches, ids = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, scheme, batches, tmp_path)
    ours = reference_model(model, scheme, batches)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
