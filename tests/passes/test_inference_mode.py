"""A transformed model under torch.inference_mode: the weight caches (rotation, fake quant) hold
normal tensors, so the same model trains afterwards and its version watches keep working."""

from __future__ import annotations

import torch

import qtransform
from qtransform.models import build_tiny

POLICY = {"rotate": [{"targets": ["Linear"], "kind": "random_hadamard", "block_size": 32, "seed": 1}],
          "quantize": [{"targets": ["Linear"], "format": "mxfp4", "tensors": ["weight", "input"]}]}


def test_inference_mode_equals_no_grad_and_training_follows() -> None:
    model = qtransform.transform(build_tiny("qwen2", seed=3), POLICY)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first = model(ids).logits
        again = model(ids).logits
    with torch.no_grad():
        plain = model(ids).logits
    assert torch.equal(first, again) and torch.equal(first, plain)
    model.train()
    model(ids).logits.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads[:5])


def test_a_model_built_under_inference_mode_runs_and_sees_weight_changes() -> None:
    with torch.inference_mode():
        model = qtransform.transform(build_tiny("qwen2", seed=3), POLICY)
        ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
        before = model(ids).logits
        assert torch.equal(before, model(ids).logits)
        for p in model.parameters():
            p.mul_(1.5)  # inference tensors have no version counter: the content check sees it
        after = model(ids).logits
    assert not torch.equal(before, after)
