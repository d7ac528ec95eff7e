"""The `transformers/FourOverSix` preset (transformers' FourOverSixConfig, the fouroversix library's
reference): its weights and its inputs equal the numpy port of the library's choice
(tests/formats/stack_fouroversix.py), each with the tensor's own amax, in transformers' words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qtransform
from qtransform.models import build_tiny
from tests.formats import stack_fouroversix as port

F32 = np.float32


def ported(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x fake-quantized as fouroversix's reference does with its whole-tensor amax: the chosen
    block scale's elements times (s * d)."""
    amax = F32(x.abs().max().item())
    d = F32(1) / port._enc(amax, 256)
    blocks = x.reshape(-1, 16).numpy()
    scales = port.fouroversix(blocks, amax, mode)[1]
    out = [[F32(v) * (F32(s) * d) for v in port.elements(b, s, d)] for b, s in zip(blocks, scales, strict=True)]
    return torch.tensor(np.array(out, dtype=np.float32)).reshape(x.shape)


@pytest.mark.parametrize(("options", "weights", "inputs"), [
    ({}, "mse", "mse"),
    ({"scale_rule": "mae"}, "mae", "mae"),
    ({"weight_scale_rule": "mae"}, "mae", "mse"),
    ({"activation_scale_rule": "mae"}, "mse", "mae"),
])
def test_weights_and_inputs_are_the_librarys_choice(options, weights, inputs):
    policy = {"preset": "transformers/FourOverSix", "preset_options": options}
    model = qtransform.transform(build_tiny("qwen2"), policy)
    module = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        assert torch.equal(module.weight_fake_quant(module.weight), ported(module.weight, weights))
        x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3
        x[1, 2, 7] = 40.0  # one token's outlier sets the scale of every token (a per-call amax)
        assert torch.equal(module.input_fake_quant(x), ported(x, inputs))
    assert not hasattr(model.lm_head, "weight_fake_quant")


def test_options_outside_the_modelled_ones_are_refused():
    for bad in ({"scale_rule": "abs_max"}, {"weight_scale_2d": True}):
        with pytest.raises(qtransform.UserError, match="not an allowed value"):
            qtransform.load_policy({"preset": "transformers/FourOverSix", "preset_options": bad})
