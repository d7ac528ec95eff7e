"""Property tests: dump/load is lossless, and mangled policies only ever raise PolicyError."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qtransform.formats import registry
from qtransform.schemas import Policy, PolicyError, dump_policy, load_policy
from qtransform.schemas.base import TENSORS
from qtransform.schemas.selectors import format_layers

EXAMPLES = [json.loads(p.read_text()) for p in sorted((Path(__file__).resolve().parents[2] / "schemas" / "examples").glob("*.json"))]
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(FAST, max_examples=100)

entries = st.sampled_from([
    "Linear", "RMSNorm", "LayerNorm", "Conv1D", "lm_head", "q_proj", "mlp.*", "model.layers.*.mlp.*",
    "re:.*q_proj", "re:model\\.layers\\.\\d+\\..*",
])
positive = st.floats(1e-6, 10.0, allow_nan=False)


@st.composite
def selector_fields(draw) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if draw(st.booleans()):
        out["targets"] = draw(st.lists(entries, min_size=1, max_size=3))
    if draw(st.booleans()):
        out["ignore"] = draw(st.lists(entries, max_size=2))
    if draw(st.booleans()):
        out["layers"] = format_layers(draw(st.lists(st.integers(0, 40), min_size=1, max_size=5)))
    return out


@st.composite
def quant_rules(draw, index: int) -> dict[str, Any]:
    spec = registry.get(draw(st.sampled_from(registry.names())))
    blocks = spec.allowed_blocks or (1, 16, 100, 128)
    rule = {**draw(selector_fields()), "format": spec.name,
            "tensors": draw(st.lists(st.sampled_from(TENSORS), min_size=1, max_size=3, unique=True))}
    if draw(st.booleans()):
        rule["name"] = f"rule{index}"
    shape = draw(st.sampled_from(["none", "size", "tile"]))
    if shape == "tile" and rule["tensors"] == ["weight"]:
        rule["block_shape"] = [draw(st.sampled_from(blocks)), draw(st.sampled_from(blocks))]
    else:
        if shape == "size":
            rule["block_size"] = draw(st.sampled_from(blocks))
        rule["axis"] = draw(st.none() | st.integers(-2, 1))
    rule["scale_rule"] = draw(st.sampled_from(spec.options.get("scale_rule", ("floor",))))
    rule["rounding"] = draw(st.sampled_from(spec.options["rounding"]))
    if rule["rounding"] == "stochastic":
        rule["seed"] = draw(st.none() | st.integers(0, 2**31))
    if "nvfp4_variant" in spec.options:
        rule["nvfp4_variant"] = draw(st.none() | st.sampled_from(spec.options["nvfp4_variant"]))
    rule["zero_saturated_grad"] = draw(st.booleans())
    return rule


@st.composite
def schedules(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["exponential", "linear", "cosine", "constant"]))
    start = draw(positive)
    out: dict[str, Any] = {"kind": kind, "sigma_start": start}
    if kind != "constant":
        low = 1e-4 if kind == "exponential" else 0.0
        out["sigma_end"] = start * draw(st.floats(low, 1.0))
    k = draw(st.integers(3, 12))
    if draw(st.booleans()):
        out.update(num_stages=k, total_steps=draw(st.integers(k, 5000)))
        out["warmup_steps"] = draw(st.integers(0, out["total_steps"] - k))
    else:
        out.update(stages_per_epoch=k, steps_per_epoch=draw(st.integers(k, 300)))
        out["epochs"] = draw(st.none() | st.integers(1, 5))
    return out


@st.composite
def policies(draw) -> dict[str, Any]:
    data: dict[str, Any] = {"version": 1}
    data["quantize"] = [draw(quant_rules(i)) for i in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        data["instrument"] = {
            **draw(selector_fields()),
            "points": draw(st.lists(st.sampled_from(TENSORS), min_size=1, unique=True)),
            "saturation": draw(st.booleans()),
            "block_exponents": draw(st.booleans()),
            "shadow": draw(st.booleans()),
            "thresholds": {"sqnr_db": draw(st.floats(-50, 80)), "deadzone": draw(st.floats(0, 1))},
        }
    if draw(st.booleans()):
        data["noise"] = {
            **draw(selector_fields()),
            "schedule": draw(schedules()),
            "layer_multipliers": draw(st.dictionaries(st.integers(0, 63).map(str), positive, max_size=6)),
            "multipliers": draw(st.lists(st.fixed_dictionaries({"targets": st.lists(entries, min_size=1, max_size=2),
                                                                "value": positive}), max_size=2)),
            "resample": draw(st.sampled_from(["step", "forward"])),
            "apply_during": draw(st.sampled_from(["train", "eval", "both"])),
            "seed": draw(st.integers(0, 2**31)),
        }
    if draw(st.booleans()):
        data["hw_error"] = {
            **draw(selector_fields()), "error_scale": draw(positive),
            "error_type": draw(st.sampled_from(["relative_gaussian", "absolute_gaussian"])),
            "injection_point": draw(st.sampled_from(TENSORS)), "include_matmuls": draw(st.booleans()),
        }
    return data


@ROUND_TRIP
@given(policies())
def test_dump_load_round_trip(data):
    policy = load_policy(data)
    dumped = dump_policy(policy)
    assert load_policy(dumped) == policy
    assert load_policy(policy.to_json()) == policy
    assert dump_policy(load_policy(json.loads(json.dumps(dumped)))) == dumped
    assert Policy.model_validate_json(policy.to_json()) == policy


# -- mutations of valid examples ---------------------------------------------------------------

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=12),
    st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
out_of_range = st.sampled_from([0, -1, -0.5, 0.0, 1e308, -1e308, 2**63, float("nan"), float("inf"), 33, 7])


def containers(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every dict and list in the tree (mutation points)."""
    found = [path] if isinstance(node, (dict, list)) and node else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        found += containers(child, (*path, key))
    return found


def at(node: Any, path: tuple) -> Any:
    for key in path:
        node = node[key]
    return node


@st.composite
def mutated(draw) -> Any:
    data = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    for _ in range(draw(st.integers(1, 3))):
        parent = at(data, draw(st.sampled_from(containers(data) or [()])))
        if not isinstance(parent, (dict, list)) or not parent:
            continue
        key = draw(st.sampled_from(list(parent) if isinstance(parent, dict) else list(range(len(parent)))))
        op = draw(st.sampled_from(["drop", "rename", "retype", "range"]))
        if op == "drop":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            cut = draw(st.integers(0, len(key)))
            parent[key[:cut] + draw(st.text("abcdefghijklmnopqrstuvwxyz_", max_size=2)) + key[cut + 1:]] = parent.pop(key)
        else:
            parent[key] = draw(junk if op == "retype" else out_of_range)
    if draw(st.booleans()):
        return data
    text = json.dumps(data, indent=2)
    if draw(st.booleans()):  # break the JSON text itself
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 8)))
        text = text[:i] + draw(st.sampled_from(["", ",", "}", "{", '"', ":", "[", "x"])) + text[j:]
    return text


@FAST
@given(mutated())
def test_mutations_raise_only_policy_errors_with_paths(data):
    try:
        policy = load_policy(data)
    except PolicyError as exc:
        assert exc.problems
        for problem in exc.problems:
            assert problem.path and problem.path in str(exc)
    else:  # accepted: what the user wrote is kept, nothing silently dropped or changed
        raw = json.loads(data) if isinstance(data, str) else data
        assert kept(raw, dump_policy(policy)), (raw, dump_policy(policy))
        assert load_policy(dump_policy(policy)) == policy


def kept(raw: Any, dumped: Any) -> bool:
    """Every key and value of `raw` is in `dumped` (which also spells out the defaults)."""
    if isinstance(raw, dict):
        return isinstance(dumped, dict) and all(k in dumped and kept(v, dumped[k])
                                                for k, v in raw.items())
    if isinstance(raw, list):
        return (isinstance(dumped, list) and len(raw) == len(dumped)
                and all(kept(a, b) for a, b in zip(raw, dumped, strict=True)))
    return raw == dumped and type(raw) is not bool or raw is dumped
