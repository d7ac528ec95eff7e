"""A preset's own selector entries are lenient (llm-compressor and ModelOpt skip an ignore entry
that matches nothing): a preset applies to a model without `lm_head` (a BERT encoder) or without
MoE modules, the plan lists the entries that matched nothing, and the user's entries stay strict."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import qtransform
from qtransform.errors import UserError
from qtransform.schemas.presets import preset_names

NORM_PRESETS = {"qerl"}  # its noise targets RMSNorm: a LayerNorm model (BERT) has none
USER = {"qerl": {"noise": {"schedule": {"total_steps": 10}}},
        # its backward Hadamard must divide every Linear's output features (64 for k_proj here)
        "quartet-ii/nvfp4": {"preset_options": {"hadamard_dim": 32}}}


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256)
    return tf.BertModel(cfg).eval()


def _tied() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return tf.Qwen2ForCausalLM(cfg).eval()


IDS = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
CALIB = [torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]


def _policy(name: str) -> dict:
    return {"version": 1, "preset": name, **USER.get(name, {})}


# the presets of Linear layers (a KV-cache preset alone selects attention modules, no lm_head)
LINEAR_PRESETS = [n for n in preset_names()
                  if any(not r.attention for r in qtransform.load_policy(_policy(n)).quantize)]


@pytest.mark.parametrize("name", [n for n in LINEAR_PRESETS if n not in NORM_PRESETS])
def test_every_preset_applies_to_an_encoder_without_lm_head(name):
    model = _bert()
    plan = qtransform.plan(model, _policy(name), {"input_ids": IDS})
    assert any(r.pass_name == "fake_quant" for r in plan.rows)
    misses = [n for n in plan.notes if "matches no site of this model" in n]
    assert misses and all("preset entry" in n for n in misses)
    assert any("lm_head" in n for n in misses)  # the entry llm-compressor/ModelOpt skip on BERT
    out = qtransform.transform(model, _policy(name), calibration=CALIB)
    with torch.no_grad():
        assert not torch.equal(out(input_ids=IDS).last_hidden_state,
                               model(input_ids=IDS).last_hidden_state)


@pytest.mark.parametrize("name", LINEAR_PRESETS)
def test_every_preset_applies_to_a_tied_embedding_model_and_skips_its_lm_head(name):
    model = _tied()
    out = qtransform.transform(model, _policy(name), calibration=CALIB)
    plan = qtransform.plan(model, _policy(name), {"input_ids": IDS})
    assert "lm_head" not in {r.site for r in plan.rows if r.pass_name == "fake_quant"}
    assert any(r.site.endswith("q_proj") for r in plan.rows if r.pass_name == "fake_quant")
    with torch.no_grad():
        assert torch.isfinite(out(input_ids=IDS).logits).all()


def test_the_users_own_unmatched_entry_is_still_refused():
    """The control: the same entry, written by the user, is a typo to report."""
    policy = {"version": 1, "preset": "llm-compressor/NVFP4A16",
              "quantize": [{"name": "llm-compressor/NVFP4A16 weights", "ignore": ["re:lm_head", "re:no_such"]}]}
    with pytest.raises(UserError, match="'re:no_such' matches no"):
        qtransform.plan(_bert(), policy, {"input_ids": IDS})
    plain = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["re:lm_head"], "format": "mxfp4"}]}
    with pytest.raises(UserError, match="'re:lm_head' matches no"):
        qtransform.plan(_bert(), plain, {"input_ids": IDS})
