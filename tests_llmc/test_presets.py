"""Every llm-compressor preset against llm-compressor itself: the same tiny model, the same
calibration samples, logits equal bit for bit (docs/recipes.md)."""

from __future__ import annotations

import copy

import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from qtransform.schemas.presets import preset_names
from tests_llmc.oneshot import llm_compressor_model

SCHEMES = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W8A8"]
# hidden 128 (intermediate 256): llm-compressor's W4A16 groups and FP8_BLOCK's activation groups
# are 128 wide and refuse narrower inputs.
HIDDEN = 128
CASES = [(arch, scheme, torch.float32) for arch in ("qwen2", "llama") for scheme in SCHEMES]
# bf16, every scheme: compressed-tensors rounds scales and x/scale to bf16 (NVFP4: its 2688/amax
# and amax/6), where a float32-only simulation would drift (the presets' scale_dtype "input").
CASES += [(arch, scheme, torch.bfloat16) for arch in ("qwen2", "llama") for scheme in SCHEMES]


def samples(vocab: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(4)]
    return batches, torch.randint(0, vocab, (3, 12), generator=g)


def test_every_llm_compressor_scheme_has_a_preset():
    assert {f"llm-compressor/{s}" for s in SCHEMES} <= set(preset_names())


@pytest.mark.parametrize(("arch", "scheme", "dtype"), [
    *(pytest.param(*case, id=f"{case[0]}-{case[1]}-{str(case[2]).removeprefix('torch.')}")
      for case in CASES)])
def test_preset_logits_equal_llm_compressor(arch, scheme, dtype, tmp_path):
    model = build_tiny(arch, hidden=HIDDEN, dtype=dtype)
    batches, ids = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, scheme, batches, tmp_path)
    ours = qtransform.transform(copy.deepcopy(model), {"preset": f"llm-compressor/{scheme}"},
                                calibration=batches)
    with torch.no_grad():
        expected, got = theirs(ids).logits, ours(ids).logits
        plain = model(ids).logits
    assert not torch.equal(expected, plain)  # the scheme changed something
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3g}"


# hidden 192: q/k/v/o and gate/up take 192 input features, no multiple of 128 (of 16 and 32, yes)
REFUSALS = [
    ("W4A16", "oneshot", ValueError, "weight column counts not divisible by group_size"),
    ("FP8_BLOCK", "forward", RuntimeError,
     r"unflatten: Provided sizes \[\d+, 128\] don't multiply up to the size of dim 2 \(192\)"),
]


@pytest.mark.parametrize(("scheme", "when", "error", "words"), REFUSALS)
def test_a_preset_refuses_the_model_llm_compressor_refuses(scheme, when, error, words, tmp_path):
    model = build_tiny("qwen2", hidden=192)
    batches, ids = samples(model.config.vocab_size)
    if when == "oneshot":
        with pytest.raises(error, match=words):
            llm_compressor_model(model, scheme, batches, tmp_path)
    else:
        theirs = llm_compressor_model(model, scheme, batches, tmp_path)
        with pytest.raises(error, match=words), torch.no_grad():
            theirs(ids)
    with pytest.raises(qtransform.UserError, match="192 input features are not a multiple of the "
                                                   "group size 128"):
        qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}, calibration=batches)


def test_groups_that_divide_are_accepted_by_both(tmp_path):
    model = build_tiny("qwen2", hidden=192)
    batches, ids = samples(model.config.vocab_size)
    theirs = llm_compressor_model(model, "NVFP4", batches, tmp_path)
    ours = qtransform.transform(copy.deepcopy(model), {"preset": "llm-compressor/NVFP4"},
                                calibration=batches)
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
