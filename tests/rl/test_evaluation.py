"""`qtransform.evaluation(model)`: the model as deployed (noise off, fake quantization kept)."""

from __future__ import annotations

import torch

import qtransform
from tests.tiny_rl import tiny_qwen2

W4 = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4"}
NOISY = {"version": 1, "quantize": [W4],
         "noise": {"targets": ["RMSNorm"], "seed": 0,
                   "schedule": {"sigma_start": 5e-2, "sigma_end": 1e-3, "num_stages": 4, "total_steps": 8}},
         "hw_error": {"error_scale": 0.05, "targets": ["Linear"], "ignore": ["lm_head"]}}
PROMPT = torch.tensor([[5, 17, 33, 8, 90]])


def greedy(model: torch.nn.Module) -> torch.Tensor:
    """The greedy tokens and the logits of every decoding step, in one tensor."""
    out = model.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return torch.cat([out.sequences.float(), torch.cat(out.logits, dim=-1)], dim=-1)


def test_generate_inside_evaluation_is_the_noise_free_model():
    model = qtransform.transform(tiny_qwen2(), NOISY)
    qtransform.noise_controller(model).set_step(3)
    clean = qtransform.transform(tiny_qwen2(), {"version": 1, "quantize": [W4]})
    with torch.no_grad():
        with qtransform.evaluation(model):
            evaluated, logits = greedy(model), model(PROMPT).logits
        assert torch.equal(evaluated, greedy(clean))
        assert torch.equal(logits, clean(PROMPT).logits)
        with qtransform.rollout():
            noised = model(PROMPT).logits  # outside: the noise is on, as before
        assert not torch.equal(noised, logits)
        assert not torch.equal(greedy(model), evaluated)
    assert all(m.enabled for m in qtransform.noise_controller(model).noise)


def test_evaluation_of_a_model_without_noise_changes_nothing():
    model = qtransform.transform(tiny_qwen2(), {"version": 1, "quantize": [W4]})
    with torch.no_grad():
        before = greedy(model)
        with qtransform.evaluation(model):
            assert torch.equal(greedy(model), before)
