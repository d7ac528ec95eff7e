"""Presets: expansion into explicit rules, the user's fields merged over them, stack selector semantics."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.checkpoints.matching import ct_entry as from_llm_compressor
from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas.explain import explain, summary
from qtransform.schemas.loading import dump_policy
from qtransform.schemas.presets import PRESETS, merge, preset_names
from qtransform.schemas.selectors import Selector

# What a preset needs from the user before it is a valid policy (the run length of a schedule).
USER_PART = {"qerl": {"noise": {"schedule": {"total_steps": 100}}}}
NVFP4A16 = "llm-compressor/NVFP4A16"
WEIGHTS = f"{NVFP4A16} weights"


def expanded(name: str, **fields):
    return load_policy({"preset": name, **USER_PART.get(name, {}), **fields})


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_expands_to_named_rules_and_round_trips(name):
    policy = expanded(name)
    assert policy.preset == name
    assert policy.quantize and all(r.name for r in policy.quantize)
    assert load_policy(dump_policy(policy)) == policy  # expansion is idempotent
    assert load_policy(policy.to_json()) == policy
    assert explain(policy).startswith(f"Preset {name}: ")
    assert summary(policy).startswith(f"preset {name}: ")


def test_preset_names_are_case_insensitive_and_canonical():
    assert load_policy({"preset": "LLM-Compressor/nvfp4a16"}).preset == NVFP4A16


def test_unknown_preset_is_one_line_with_the_list_and_a_suggestion():
    with pytest.raises(PolicyError) as info:
        load_policy({"preset": "llm-compressor/NVFP4A61"})
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("invalid policy: preset: unknown preset; got 'llm-compressor/NVFP4A61'; allowed: ")
    assert all(n in text for n in preset_names())
    assert text.endswith(f"(did you mean {NVFP4A16!r}?)")


def test_preset_must_be_a_string():
    with pytest.raises(PolicyError, match=r"preset: expected a preset name '<stack>/<scheme>'.*; got 4"):
        load_policy({"preset": 4})


def test_user_rule_named_like_a_preset_rule_changes_it_in_place():
    policy = expanded(NVFP4A16, quantize=[{"name": WEIGHTS, "ignore": ["lm_head", "re:.*\\.0\\..*"]}])
    (rule,) = policy.quantize
    assert rule.name == WEIGHTS and rule.ignore == ["lm_head", "re:.*\\.0\\..*"]
    assert rule.format == "nvfp4" and rule.nvfp4_variant == "compressed-tensors"  # the rest kept


def test_other_user_rules_come_after_the_preset_rules():
    policy = expanded(NVFP4A16, quantize=[{"targets": ["re:.*down_proj"], "format": "mxfp4"}])
    assert [r.name for r in policy.quantize] == [WEIGHTS, None]
    assert policy.quantize[1].format == "mxfp4"


def test_user_sections_merge_over_the_preset_and_null_removes_one():
    policy = expanded("qerl", noise={"schedule": {"total_steps": 50, "sigma_start": 0.02}, "seed": 3})
    assert policy.noise.schedule.sigma_start == 0.02 and policy.noise.schedule.sigma_end == 1e-4
    assert policy.noise.schedule.num_stages == 10 and policy.noise.seed == 3
    assert policy.noise.apply_during == "rollout"
    assert load_policy({"preset": "qerl", "noise": None}).noise is None


def test_qerl_without_a_run_length_says_what_to_add():
    with pytest.raises(PolicyError, match="noise.schedule.total_steps: missing: give total_steps"):
        load_policy({"preset": "qerl"})


def test_qerl_is_nvfp4a16_plus_rollout_aqn():
    qerl, base = expanded("qerl"), expanded(NVFP4A16)
    assert qerl.quantize == base.quantize
    assert qerl.noise.targets == ["RMSNorm"] and qerl.noise.apply_during == "rollout"
    sched = qerl.noise.schedule
    assert (sched.kind, sched.sigma_start, sched.sigma_end, sched.num_stages) == ("exponential", 1e-2, 1e-4, 10)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(["a", "b"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["a", "b", "name"]), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(base=json_values, over=json_values)
def test_merge_is_idempotent(base, over):
    """What a written-back policy relies on: merging the merged result again changes nothing."""
    once = merge(base, over)
    assert merge(base, once) == once


# -- llm-compressor's selector semantics -----------------------------------------------------

class Site:
    def __init__(self, name: str, cls_name: str = "Linear"):
        self.name, self.cls_name, self.kind, self.layer = name, cls_name, "linear", None


def llmc_matches(entry: str, name: str) -> bool:
    """compressed-tensors' `match_name` for a name entry: re.match after 're:', else equality."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


NAMES = ["lm_head", "model.lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_up_proj",
         "model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.0.up_proj",
         "model.layers.10.self_attn.q_proj", "model.layers.0.block_sparse_moe.gate"]
ENTRIES = ["lm_head", "re:.*mlp.gate$", "re:.*mlp.gate", "re:model.layers.1", "re:.*proj",
           "re:.*block_sparse_moe.gate$", "model.layers.0.mlp.gate", "mlp.gate", "re:lm_"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_translated_entries_match_exactly_what_llm_compressor_matches(entry):
    selector = Selector.compile([from_llm_compressor(entry)])
    for name in NAMES:
        assert selector.matches(Site(name)) == llmc_matches(entry, name), (entry, name)


def test_router_pattern_never_matches_gate_up_proj():
    selector = Selector.compile(["Linear"], [from_llm_compressor("re:.*mlp.gate$")])
    assert not selector.matches(Site("model.layers.0.mlp.gate"))
    assert selector.matches(Site("model.layers.0.mlp.gate_up_proj"))
    assert selector.matches(Site("model.layers.0.mlp.gate_proj"))


name_parts = st.lists(st.sampled_from(["model", "layers", "0", "12", "mlp", "gate", "gate_up_proj",
                                       "lm_head", "q_proj", "experts"]), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(parts=name_parts, prefix=st.lists(st.sampled_from(["model", "mlp", "gate", "0", ".*", "\\."]),
                                          min_size=1, max_size=3), dollar=st.booleans())
def test_translation_agrees_with_re_match_on_any_name(parts, prefix, dollar):
    name = ".".join(parts)
    entry = "re:" + "".join(prefix) + ("$" if dollar else "")
    assert Selector.compile([from_llm_compressor(entry)]).matches(Site(name)) == llmc_matches(entry, name)
    plain = ".".join(parts[:2])
    assert Selector.compile([from_llm_compressor(plain)]).matches(Site(name)) == (plain == name)


def test_class_entries_stay_class_selectors():
    assert from_llm_compressor("Linear") == "Linear"


def test_registry_refuses_unnamed_rules_and_unknown_sections():
    from qtransform.schemas.presets import Preset, register_preset

    with pytest.raises(ValueError, match="needs a name"):
        register_preset(Preset("x/unnamed", "r", "", {"quantize": [{"format": "nvfp4"}]}))
    with pytest.raises(ValueError, match="are not policy sections"):
        register_preset(Preset("x/odd", "r", "", {"quantise": []}))
    with pytest.raises(ValueError, match="registered already"):
        register_preset(PRESETS[NVFP4A16])


def test_recipes_doc_shows_every_preset_expansion():
    """docs/recipes.md stays true: each llm-compressor preset's row holds its `policy explain` words."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    for name in preset_names():
        if name.startswith("llm-compressor/"):
            words = " ".join(explain(expanded(name)).split("\n")[1:]).replace("|", "\\|")
            assert f"| `{name}` |" in doc and words in doc, (
                f"docs/recipes.md: the row of {name} must show its expansion: {words}")
