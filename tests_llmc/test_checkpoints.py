"""llm-compressor's saved checkpoints opened by qtransform's own reader:
for every preset scheme, the decompressed weights equal compressed-tensors' own decompression
(transformers with compressed-tensors, bf16) bit for bit, and transforming the opened model with
`checkpoint_policy` gives llm-compressor's quantized model's logits bit for bit."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.models import build_tiny, checkpoint_policy, load_model
from tests_llmc.oneshot import llm_compressor_model
from tests_llmc.test_presets import HIDDEN, SCHEMES, samples


@pytest.mark.parametrize("scheme", SCHEMES)
def test_opened_checkpoint_equals_compressed_tensors_and_llm_compressor(scheme, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    # a model as transformers loads it (its rotary inv_freq stays fp32), so that the saved and
    # the in-memory quantized models differ only by what the checkpoint holds
    build_tiny("qwen2", hidden=HIDDEN, dtype=torch.bfloat16).save_pretrained(tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16).eval()
    batches, ids = samples(model.config.vocab_size)
    quantized = llm_compressor_model(model, scheme, batches, tmp_path / "work")
    with torch.no_grad():
        expected = quantized(ids).logits
    folder = tmp_path / "compressed"
    quantized.save_pretrained(folder, save_compressed=True)

    ours = load_model(folder)
    theirs = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False))
    reference = theirs.state_dict()
    for name, value in ours.state_dict().items():
        assert value.dtype == reference[name].dtype, name
        assert torch.equal(value, reference[name]), name

    policy = checkpoint_policy(ours)
    assert policy is not None
    with torch.no_grad():
        got = qtransform.transform(ours, policy)(ids).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"
