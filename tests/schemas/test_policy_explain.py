"""`explain`: every rule and section in plain words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtransform.schemas import load_policy
from qtransform.schemas.explain import explain, summary

EXAMPLES = Path(__file__).resolve().parents[2] / "schemas" / "examples"
SECTIONS = {"instrument": "Instrumentation: ", "noise": "AQN noise: ", "hw_error": "Hardware error: ",
            "activation_noise": "Activation noise: "}


def test_rule_sentence():
    p = load_policy({"quantize": [{"name": "w4", "format": "mxfp4", "ignore": ["lm_head"]}]})
    assert explain(p) == (
        "Rule 'w4' quantizes the weights (W4A16) of modules matching class Linear, except lm_head "
        "or MoE routers (kept in high precision unless named, e.g. Router), to MXFP4 (E2M1 "
        "elements, block 32, E8M0 scale, floor scale rule, round-half-even)."
    )


def test_routers_are_excepted_only_from_linear_class_targets():
    def sentence(**rule):
        return explain(load_policy({"quantize": [{"format": "mxfp4", **rule}]}))

    assert "except MoE routers" in sentence(targets=["Linear"])
    assert "routers" not in sentence(targets=["Linear", "Router"])
    assert "routers" not in sentence(targets=["re:.*mlp\\.gate"])
    assert "modules matching class Router to MXFP4" in sentence(targets=["Router"])


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"format": "mxfp4", "tensors": ["input"]}, "the input activations (W16A4)"),
        ({"format": "mxfp6_e3m2", "tensors": ["weight", "input"]}, "the weights and input activations (W6A6)"),
        ({"format": "mxfp8_e4m3", "tensors": ["output"]}, "the outputs of"),
        ({"format": "int4", "block_size": 64}, "(W4A16)"),
        ({"format": "nvfp4", "block_shape": [16, 16]}, "16x16 weight tiles, E4M3 block scale x FP32 tensor scale"),
        ({"format": "mxint8", "rounding": "stochastic", "seed": 7}, "INT8 elements, block 32, E8M0 scale, floor "
                                                                    "scale rule, stochastic rounding (seed 7)"),
        ({"format": "mxfp4", "targets": ["re:.*mlp\\..*"], "layers": "10-17,20"},
         "modules matching regex '.*mlp\\\\..*', in layers 10-17,20, to MXFP4"),
        ({"format": "mxfp4", "targets": ["model.layers.*.mlp.*"]}, "modules matching 'model.layers.*.mlp.*' to MXFP4"),
    ],
)
def test_rule_details(fields, words):
    text = explain(load_policy({"quantize": [fields]}))
    assert text.startswith("Rule quantize[0] quantizes ") and words in text


def test_override_note_only_with_several_rules():
    two = load_policy({"quantize": [{"format": "mxfp4"}, {"format": "nvfp4", "targets": ["down_proj"]}]})
    assert "A later rule overrides an earlier one" in explain(two)
    assert "overrides" not in explain(load_policy({"quantize": [{"format": "mxfp4"}]}))


def test_noise_schedule_and_multipliers():
    text = explain(load_policy(EXAMPLES / "qerl_aqn.json"))
    assert "AQN noise: Gaussian noise on the weights of modules matching class RMSNorm" in text
    assert ("1000 steps in 10 stages of ~100 steps; stage 0 is noise-free, then sigma = 0.01, "
            "0.00562, 0.00316, 0.00178, ..., 0.0001.") in text
    srdd = explain(load_policy(EXAMPLES / "srdd_guided_aqn.json"))
    assert "Sigma multipliers (combined by product): x1.2 in layers 10-13,18-21; x1.5 in layers 14-17." in srdd
    assert "each epoch of 58 steps runs the schedule in 5 stages (3 epochs)" in srdd


def test_instrument_and_hw_error():
    text = explain(load_policy({"instrument": {"points": ["weight"], "block_exponents": False},
                                "hw_error": {"error_scale": 0.05}}))
    assert ("Instrumentation: taps the weights of modules matching class Linear, except MoE routers "
            "(kept in high precision unless named, e.g. Router), and records the error metrics and "
            "saturation on a shadow copy") in text
    assert "flagged when SQNR < 20 dB, deadzone > 0.05, saturation > 0.01 or rel_rmse > 0.1" in text
    assert "Hardware error: relative gaussian y*(1 + s*z) with s = 0.05, z ~ N(0, 1), on the outputs" in text


def test_summary_and_empty():
    p = load_policy(EXAMPLES / "srdd_guided_aqn.json")
    assert summary(p) == ("1 quantize rule(s) (mxfp4 W4A16), instrument (weight), "
                          "noise (exponential, sigma_start 0.01, 5 stages)")
    assert explain(load_policy({})) == "The policy is empty: it changes nothing."
    assert summary(load_policy({})) == "empty policy"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")), ids=lambda p: p.name)
def test_every_example_explains(path):
    """One paragraph per section of the example, in order, naming what its JSON says."""
    raw = json.loads(path.read_text())
    rotations, rules = raw.get("rotate", []), raw.get("quantize", [])
    heads = [f"Rotate[{i}] '{r['name']}': " for i, r in enumerate(rotations)]
    heads += [f"Rule '{r['name']}' quantizes " for r in rules]
    heads += ["A later rule overrides"] * (len(rules) > 1)
    heads += [SECTIONS[k] for k in SECTIONS if k in raw]
    paragraphs = [ln for ln in explain(load_policy(path)).splitlines() if not ln.startswith("  ")]
    assert len(paragraphs) == len(heads)
    assert all(p.startswith(h) for p, h in zip(paragraphs, heads, strict=True)), paragraphs
    sections = list(rotations) + list(rules) + [raw[k] for k in SECTIONS if k in raw]
    for text, section in zip([p for p in paragraphs if not p.startswith("A later")], sections,
                             strict=True):
        assert all(f"class {t}" in text for t in section.get("targets", []))
        assert all(f"except {i}" in text for i in section.get("ignore", []))
        if "format" in section:
            assert f"to {section['format'].upper()} (" in text
        if "seed" in section:
            assert f"seed {section['seed']}" in text
