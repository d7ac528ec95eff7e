"""Policy models: defaults, format options, readable errors, loading, legacy conversion, schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import qtransform
from qtransform.errors import UserError
from qtransform.formats import registry
from qtransform.schemas import (
    Policy,
    PolicyError,
    QuantRule,
    dump_policy,
    from_legacy_srdd,
    load_policy,
)
from qtransform.schemas.generate import SCHEMA_PATH, schema_text

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "schemas" / "examples").glob("*.json"))
SCHEDULE = {"sigma_start": 0.01, "sigma_end": 0.0001, "num_stages": 10, "total_steps": 1000}


def problems(data) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy(data)
    return [str(p) for p in info.value.problems]


def rule(**fields) -> dict:
    return {"quantize": [{"format": "mxfp4", **fields}]}


def test_exports_and_error_type():
    assert qtransform.load_policy is load_policy and qtransform.Policy is Policy
    assert issubclass(PolicyError, UserError) and issubclass(PolicyError, ValueError)


def test_defaults():
    p = load_policy({"quantize": [{"format": "MXFP4"}], "instrument": {}, "noise": {"schedule": SCHEDULE},
                     "hw_error": {"error_scale": 0.05}})
    r = p.quantize[0]
    assert p.version == 1 and r.format == "mxfp4" and r.targets == ["Linear"] and r.ignore == []
    assert (r.tensors, r.scale_rule, r.rounding, r.block_size, r.axis, r.seed) == (["weight"], "floor", "rne", None, None, None)
    assert p.instrument.points == ["weight", "input", "output"]
    assert p.instrument.saturation is True and p.instrument.block_exponents is True
    assert p.instrument.shadow and p.instrument.thresholds.sqnr_db == 20.0
    assert (p.instrument.thresholds.deadzone, p.instrument.thresholds.saturation, p.instrument.thresholds.relative_error) == (0.05, 0.01, 0.10)
    n = p.noise
    assert n.targets == ["RMSNorm", "LayerNorm"] and (n.resample, n.apply_during, n.seed) == ("step", "rollout", 0)  # QeRL: AQN only in rollouts
    assert n.schedule.kind == "exponential" and n.schedule.warmup_steps == 0 and n.schedule.stages == 10
    h = p.hw_error
    assert (h.targets, h.error_type, h.injection_point, h.apply_during, h.seed, h.include_matmuls) == (
        ["Linear"], "relative_gaussian", "output", "both", 0, False)


def test_rule_config_is_the_canonical_options_object():
    """A rule becomes one QuantConfig: every option of its family spelled out, the axis left
    unbound until a site binds it, the seed kept for stochastic rounding."""
    mx = QuantRule(format="mxfp4", block_size=64, scale_rule="rceil", rounding="stochastic", seed=3).config()
    assert (mx.name, mx.block, mx.tile, mx.axis, mx.seed) == ("mxfp4", 64, None, None, 3)
    assert mx.options() == {"block_size": 64, "scale_rule": "rceil", "rounding": "stochastic", "seed": 3}
    assert mx.bind(0).axis == 0 and mx.bind(0).bind(1).axis == 0
    nv = QuantRule(format="nvfp4", nvfp4_variant="compressed-tensors", block_shape=(16, 16),
                   zero_saturated_grad=True).config()
    assert nv.options() == {"block_shape": [16, 16], "axis": -1, "rounding": "rne",
                            "nvfp4_variant": "compressed-tensors", "zero_saturated_grad": True}
    assert nv.bind(0).axis == -1  # tiles have no blocking axis to bind
    assert QuantRule(format="int4", block_size=100, axis=0).config().options() == {
        "block_size": 100, "axis": 0, "rounding": "rne", "int_range": "restricted",
        "scale_dtype": "float32"}
    assert QuantRule(format="nvfp4").config().options() == {
        "block_size": 16, "rounding": "rne", "nvfp4_variant": "default"}


def test_unknown_format_and_misspelt_key_suggest():
    assert problems(rule(format="mxfp5"))[0].startswith(
        "quantize[0].format: unknown format; got 'mxfp5'; allowed: " + ", ".join(registry.names()))
    assert problems(rule(format="mxfp5"))[0].endswith("(did you mean 'mxfp4'?)")
    (msg,) = problems({"quantize": [{"format": "mxfp4", "blok_size": 32}]})
    assert msg.startswith("quantize[0].blok_size: unknown field; allowed: targets,") and msg.endswith("(did you mean 'block_size'?)")
    (msg,) = problems({"quantise": []})
    assert "(did you mean 'quantize'?)" in msg
    assert problems({"noise": {"schedule": SCHEDULE, "apply_during": "trian"}}) == [
        "noise.apply_during: unknown value; got 'trian'; allowed: train, eval, both, rollout (did you mean 'train'?)"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"block_size": 33}, "quantize[0].block_size: not a block size of mxfp4; got 33; allowed: 2, 4,"),
        ({"format": "int4", "block_size": 0}, "quantize[0].block_size: must be > 0; got 0"),
        ({"block_size": "32"}, "quantize[0].block_size: expected an integer; got '32'"),
        ({"block_shape": [32, 32], "tensors": ["weight", "input"]}, "quantize[0].block_shape: 2D tiles apply to weights only"),
        ({"block_shape": [32, 48]}, "quantize[0].block_shape[1]: not a block size of mxfp4; got 48"),
        ({"block_shape": [32, 32], "block_size": 32}, "quantize[0].block_shape: give block_size or block_shape, not both"),
        ({"format": "nvfp4", "scale_rule": "rceil"}, "quantize[0].scale_rule: not supported by nvfp4; got 'rceil'; allowed: floor"),
        ({"scale_rule": "flor"}, "quantize[0].scale_rule: unknown value; got 'flor'; allowed: floor, rceil, ceil, even, compressed-tensors (did you mean 'floor'?)"),
        ({"rounding": "nearest"}, "quantize[0].rounding: unknown value; got 'nearest'; allowed: rne, rna, rtz, stochastic"),
        ({"nvfp4_variant": "default"}, "quantize[0].nvfp4_variant: mxfp4 takes no nvfp4_variant; remove it"),
        ({"seed": 1}, "quantize[0].seed: only used with rounding 'stochastic'; got 1"),
        ({"tensors": ["weight", "weight"]}, "quantize[0].tensors[1]: duplicate item; got 'weight'"),
        ({"tensors": []}, "quantize[0].tensors: needs at least 1 item(s)"),
        ({"targets": ["Linear", "re:[abc"]}, "quantize[0].targets[1]: invalid regular expression:"),
        ({"layers": "17-10"}, "quantize[0].layers: layer range '17-10' runs backwards; write 10-17"),
        ({"zero_saturated_grad": 1}, "quantize[0].zero_saturated_grad: expected true or false; got 1"),
    ],
)
def test_quant_rule_problems(fields, expected):
    assert any(p.startswith(expected) for p in problems(rule(**fields))), problems(rule(**fields))


def test_rule_names_unique():
    assert problems({"quantize": [{"format": "mxfp4", "name": "a"}, {"format": "nvfp4", "name": "a"}]}) == [
        "quantize[1].name: rule names must be unique; got 'a'"]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ({"sigma_end": 0.0}, "noise.schedule.sigma_end: must be > 0 for an exponential schedule"),
        ({"sigma_end": 0.1}, "noise.schedule.sigma_end: must be <= sigma_start"),
        ({"num_stages": 2}, "noise.schedule.num_stages: the exponential (QeRL) schedule needs at least 3 stages"),
        ({"steps_per_epoch": 58}, "noise.schedule.total_steps: give total_steps or steps_per_epoch and stages_per_epoch, not both"),
        ({"total_steps": None}, "noise.schedule.total_steps: missing: give total_steps, or steps_per_epoch"),
        ({"total_steps": None, "num_stages": None, "steps_per_epoch": 58}, "noise.schedule.stages_per_epoch: missing"),
        ({"total_steps": 5}, "noise.schedule.total_steps: too few steps for 10 stages; got 5"),
        ({"warmup_steps": 1000}, "noise.schedule.warmup_steps: leaves no step to train"),
        ({"epochs": 3}, "noise.schedule.epochs: only used with steps_per_epoch and stages_per_epoch"),
        ({"kind": "constant"}, "noise.schedule.sigma_end: not used by a constant schedule"),
        ({"kind": "linear", "num_stages": 1}, "noise.schedule.num_stages: must be > 1"),
        ({"kind": "exp"}, "noise.schedule.kind: unknown value; got 'exp'; allowed: exponential, linear, cosine, constant"),
        ({"sigma_start": float("nan")}, "noise.schedule.sigma_start: must be a finite number"),
        ({"sigma_start": True}, "noise.schedule.sigma_start: expected a number; got true"),
    ],
)
def test_schedule_problems(schedule, expected):
    sched = {k: v for k, v in {**SCHEDULE, **schedule}.items() if v is not None}
    if expected.endswith("must be > 1"):  # num_stages 1 < 2 for a linear schedule
        expected = "noise.schedule.num_stages: needs at least 2 stages"
    found = problems({"noise": {"schedule": sched}})
    assert any(p.startswith(expected) for p in found), found


def test_per_epoch_schedule_and_linear_zero_end_are_valid():
    p = load_policy({"noise": {"schedule": {"sigma_start": 0.05, "sigma_end": 0.0005, "steps_per_epoch": 58,
                                            "stages_per_epoch": 5, "epochs": 3}}})
    assert p.noise.schedule.per_epoch and p.noise.schedule.stages == 5
    linear = load_policy({"noise": {"schedule": {**SCHEDULE, "kind": "linear", "sigma_end": 0.0}}})
    s = linear.noise.schedule
    assert (s.kind, s.sigma_start, s.sigma_end, s.stages) == ("linear", 0.01, 0.0, 10)


def test_noise_multipliers_problems():
    found = problems({"noise": {"schedule": SCHEDULE, "layer_multipliers": {"x": 1.0, "3": 1.0, "03": 2.0}}})
    assert found == [
        "noise.layer_multipliers.x: key must be a layer index (a non-negative integer); got 'x'",
        'noise.layer_multipliers["03"]: layer 3 is given twice; got \'03\'',
    ]
    assert problems({"noise": {"schedule": SCHEDULE, "layer_multipliers": {"14": -1.5}}}) == [
        'noise.layer_multipliers[14]: must be > 0; got -1.5']
    assert problems({"noise": {"schedule": SCHEDULE, "multipliers": [{"targets": ["q_proj"], "value": 0}]}}) == [
        "noise.multipliers[0].value: must be > 0; got 0"]
    assert problems({"noise": {"schedule": SCHEDULE, "multipliers": [{"value": 2.0}]}}) == [
        "noise.multipliers[0].targets: required field is missing"]


def test_instrument_and_hw_error_problems():
    found = problems({"instrument": {"points": ["weight", "wieght"], "thresholds": {"deadzone": 2}},
                      "hw_error": {"error_type": "relative", "error_scale": -0.05}})
    assert found[0].startswith("instrument.points[1]: unknown value; got 'wieght'; allowed: weight, input,")
    assert found[0].endswith("(did you mean 'weight'?)")
    assert "instrument.thresholds.deadzone: must be <= 1; got 2" in found
    assert problems({"instrument": {"metrics": ["sqnr_db"]}}) == [
        "instrument.metrics: removed: every error metric is always computed (one pass); delete this "
        "field, and set saturation / block_exponents to false to skip those two; got [\"sqnr_db\"]"]
    assert any(p.startswith("hw_error.error_type: unknown value; got 'relative'") for p in found)
    assert "hw_error.error_scale: must be > 0; got -0.05" in found
    assert problems({"hw_error": {}}) == ["hw_error.error_scale: required field is missing"]


def test_version():
    assert problems({"version": 2}) == ["version: unsupported policy version; got 2; allowed: 1"]
    assert problems({"version": True}) == ["version: unsupported policy version; got true; allowed: 1"]


def test_message_lists_every_problem_with_its_path():
    with pytest.raises(PolicyError) as info:
        load_policy({"quantize": [{"format": "mxfp5"}, {"fromat": "x"}], "hw_error": {"error_scale": 0}})
    text = str(info.value)
    assert text.startswith("invalid policy (4 problems):\n")
    for path in ("quantize[0].format", "quantize[1].format", "quantize[1].fromat", "hw_error.error_scale"):
        assert f"\n  {path}: " in text


def test_load_sources(tmp_path):
    text = (EXAMPLES[0]).read_text()
    expected = load_policy(json.loads(text))
    path = tmp_path / "p.json"
    path.write_text(text)
    assert load_policy(path) == load_policy(str(path)) == load_policy(text) == expected
    assert load_policy(expected) is expected


def test_load_errors(tmp_path):
    assert problems(str(tmp_path / "missing.json")) == [f"{tmp_path / 'missing.json'}: no such file (and not JSON text)"]
    assert problems(tmp_path / "missing.json") == [f"{tmp_path / 'missing.json'}: no such file"]
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "quantize": [\n    {"format": "mxfp4",}\n  ]\n}\n')
    (msg,) = problems(bad)
    assert msg.startswith("line 3, column 24: invalid JSON: Expecting property name")
    with pytest.raises(PolicyError, match=f"^invalid policy {bad}: line 3, column 24: invalid JSON"):
        load_policy(bad)
    assert problems('{"quantize": [], "quantize": []}') == ["key 'quantize': appears twice in one JSON object"]
    assert problems("[1, 2]") == ["(policy): expected a JSON object; got [1, 2]"]
    assert problems(42)[0].startswith("(policy): expected a Policy, a dict, JSON text or a path")


def test_dump_is_lossless_and_explicit():
    p = load_policy(EXAMPLES[-1])
    data = dump_policy(p)
    assert data["version"] == 1 and "scale_rule" in data["quantize"][0]
    assert load_policy(data) == p and load_policy(p.to_json()) == p
    legacy = from_legacy_srdd({"base_sigma": 0.01, "layer_multipliers": {"14": 1.5}}, total_steps=100)
    assert dump_policy(legacy)["noise"]["layer_multipliers"] == {"14": 1.5}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    policy = load_policy(path)
    assert load_policy(dump_policy(policy)) == policy


def test_example_set_is_complete():
    assert {p.name for p in EXAMPLES} >= {"w4a16_mxfp4.json", "nvfp4_w4a16.json", "w16a4_mxfp4.json",
                                          "qerl_aqn.json", "srdd_guided_aqn.json", "hw_error_5pct.json"}


def test_committed_schema_is_current():
    assert SCHEMA_PATH.read_text(encoding="utf-8") == schema_text(), (
        "schemas/policy.schema.json is stale: run python -m qtransform.schemas.generate")
    schema = json.loads(schema_text())
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["QuantRule"]["properties"]["format"]["enum"] == list(registry.names())


def test_legacy_policy_is_refused_with_a_pointer_to_the_converter():
    (msg,) = problems({"base_sigma": 0.01, "layer_multipliers": {"14": 1.5}})
    assert msg.startswith("(policy): this is a legacy SRDD sigma config") and "from_legacy_srdd" in msg and "--legacy" in msg


def test_from_legacy_srdd():
    cfg = {"base_sigma": 0.01, "layer_multipliers": {"14": 1.5, "15": 1.5, "10": 1.2}}
    p = from_legacy_srdd(cfg, total_steps=174)
    s = p.noise.schedule
    assert (s.kind, s.sigma_start, s.sigma_end, s.total_steps, s.stages) == ("exponential", 0.01, pytest.approx(1e-4), 174, 10)
    assert p.noise.layer_multipliers == {14: 1.5, 15: 1.5, 10: 1.2} and p.quantize == []
    full = from_legacy_srdd({"sigma_start": 0.05, "sigma_end": 0.0005, "stages_per_epoch": 5, "steps_per_epoch": 58,
                             "layer_types": ["linear"], "exclude_patterns": ["lm_head"]})
    assert full.noise.targets == ["Linear"] and full.noise.ignore == ["lm_head"] and full.noise.schedule.stages == 5
    with pytest.raises(PolicyError) as info:
        from_legacy_srdd({"base_sigma": 0.01, "layer_multiplers": {}})
    found = [str(p) for p in info.value.problems]
    assert found[0].startswith("layer_multiplers: unknown legacy key") and found[0].endswith("(did you mean 'layer_multipliers'?)")
    assert found[1].startswith("total_steps: the legacy config gives no training length")
    with pytest.raises(PolicyError, match=r"noise\.schedule\.sigma_end: must be > 0"):
        from_legacy_srdd({"base_sigma": 0.2, "sigma_end": 0.0, "num_stages": 5}, total_steps=50)
