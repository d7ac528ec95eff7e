"""The selector language: entry kinds, precedence, layer specs, unmatched entries, suggestions."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from qtransform.core.sites import Site
from qtransform.schemas import Policy, Selector, closest_names, parse_layers, resolve_quant_rules
from qtransform.schemas.selectors import compile_entry, format_layers, is_class_entry


@dataclass(frozen=True)
class FakeSite:
    name: str
    cls_name: str
    kind: str
    layer: int | None


def qwen_sites(n_layers: int = 4) -> list[FakeSite]:
    sites = [FakeSite("model.embed_norm", "Qwen2RMSNorm", "norm", None)]
    for i in range(n_layers):
        p = f"model.layers.{i}"
        sites.append(FakeSite(f"{p}.input_layernorm", "Qwen2RMSNorm", "norm", i))
        for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sites.append(FakeSite(f"{p}.self_attn.{leaf}", "Linear", "linear", i))
        for leaf in ("gate_proj", "up_proj", "down_proj"):
            sites.append(FakeSite(f"{p}.mlp.{leaf}", "Linear", "linear", i))
    sites += [FakeSite("model.norm", "Qwen2RMSNorm", "norm", None), FakeSite("lm_head", "Linear", "linear", None)]
    return sites


def chosen(selector: Selector, sites) -> list[str]:
    return [s.name for s in sites if selector.matches(s)]


def test_entry_kinds():
    assert compile_entry("Linear").kind == "class"
    assert compile_entry("RMSNorm").kind == "class"
    assert compile_entry("re:.*q_proj").kind == "regex"
    for glob in ("lm_head", "model.layers.*.mlp.*", "Model.x", "Lin*", "L?near"):
        assert compile_entry(glob).kind == "glob"


@pytest.mark.parametrize(
    ("entry", "cls_name", "kind", "hit"),
    [
        ("RMSNorm", "Qwen2RMSNorm", "norm", True),
        ("RMSNorm", "LlamaRMSNorm", "norm", True),
        ("RMSNorm", "RMSNorm", "norm", True),
        ("LayerNorm", "LayerNorm", "norm", True),
        ("LayerNorm", "Qwen2RMSNorm", "norm", False),
        ("RMSNorm", "LayerNorm", "norm", False),
        ("Linear", "Linear", "linear", True),
        ("Linear", "Conv1D", "conv1d", True),  # GPT-2's Conv1D is a linear site
        ("Linear", "Linear8bitLt", "linear", True),  # any nn.Linear subclass has kind linear
        ("Conv1D", "Conv1D", "conv1d", True),
        ("Conv1D", "Linear", "linear", False),
        ("Linear", "Qwen2RMSNorm", "norm", False),
        ("Linear", "matmul", "matmul", False),
    ],
)
def test_class_selector(entry, cls_name, kind, hit):
    assert compile_entry(entry).matches(FakeSite("m.x", cls_name, kind, 0)) is hit


def test_glob_matches_whole_name_or_dotted_suffix():
    site = FakeSite("model.layers.3.mlp.down_proj", "Linear", "linear", 3)
    for entry in ("down_proj", "mlp.down_proj", "model.layers.*.mlp.*", "*.down_*", "*proj"):
        assert compile_entry(entry).matches(site), entry
    for entry in ("own_proj", "mlp", "layers.3", "Down_proj"):  # no partial words, case-sensitive
        assert not compile_entry(entry).matches(site), entry


def test_regex_is_fullmatch_not_search():
    gate = FakeSite("model.layers.0.mlp.gate", "Linear", "linear", 0)
    gate_proj = FakeSite("model.layers.0.mlp.gate_proj", "Linear", "linear", 0)
    entry = compile_entry("re:.*gate")
    assert entry.matches(gate) and not entry.matches(gate_proj)  # re.match would take both
    assert not compile_entry("re:mlp").matches(gate)  # re.search would match
    assert compile_entry("re:.*gate.*").matches(gate_proj)


@pytest.mark.parametrize("bad", ["", " Linear", "re:", "re:[abc", "re:(", "re:a{99999999999}"])
def test_bad_entries_raise_value_error(bad):
    with pytest.raises(ValueError):
        compile_entry(bad)


def test_parse_and_format_layers():
    assert set(parse_layers("10-17,20")) == {*range(10, 18), 20}
    assert set(parse_layers(" 3 , 5 - 6 ")) == {3, 5, 6}
    assert format_layers(parse_layers("0-2,4,6-7")) == "0-2,4,6-7"
    for bad in ("", "a", "3-1", "1,,2", "-1", "1-", "1.5"):
        with pytest.raises(ValueError):
            parse_layers(bad)


def test_ignore_beats_targets_and_layers_restrict():
    sites = qwen_sites()
    sel = Selector.compile(["Linear"], ["lm_head", "re:.*self_attn\\..*"], "1-2")
    names = chosen(sel, sites)
    assert names and all(".mlp." in n for n in names)
    assert {int(n.split(".")[2]) for n in names} == {1, 2}
    # an ignored site stays out even if it is also targeted by name
    assert "lm_head" not in chosen(Selector.compile(["lm_head", "Linear"], ["lm_head"]), sites)


def test_site_without_layer_is_excluded_when_layers_given():
    sites = qwen_sites()
    assert "model.norm" in chosen(Selector.compile(["RMSNorm"]), sites)
    assert "model.norm" not in chosen(Selector.compile(["RMSNorm"], layers="0-99"), sites)


def test_unmatched_entries_reports_typos_inside_layers():
    sites = qwen_sites(4)
    sel = Selector.compile(["Linear", "*.q_prj"], ["lm_haed", "lm_head"])
    assert sel.unmatched_entries(sites) == ["*.q_prj", "lm_haed"]
    assert Selector.compile(["Linear"], layers="40-50").unmatched_entries(sites) == ["Linear"]


def test_default_targets_are_alternatives():
    """noise's default ["RMSNorm", "LayerNorm"]: a Qwen model has no LayerNorm, that is fine."""
    policy = Policy.model_validate({"noise": {"schedule": {"sigma_start": 0.01, "sigma_end": 0.001, "total_steps": 100}}})
    sites = qwen_sites()
    assert policy.noise.selector().unmatched_entries(sites) == []
    assert policy.noise.selector().unmatched_entries([s for s in sites if s.kind == "linear"]) == [
        "RMSNorm", "LayerNorm",
    ]
    explicit = Selector.compile(["RMSNorm", "LayerNorm"])
    assert explicit.unmatched_entries(sites) == ["LayerNorm"]


def test_closest_names():
    names = [s.name for s in qwen_sites(2)]
    assert closest_names("lm_haed", names) == ["lm_head"]
    assert closest_names("model.layers.1.mlp.up_prj", names)[0] == "model.layers.1.mlp.up_proj"
    assert closest_names("zzzzzz", names) == []
    assert len(closest_names("q_proj", names, n=1)) == 1


def test_later_rule_overrides_earlier_per_site_and_tensor():
    policy = Policy.model_validate({"quantize": [
        {"name": "all", "format": "mxfp4", "tensors": ["weight", "input"], "ignore": ["lm_head"]},
        {"name": "mlp8", "format": "mxfp8_e4m3", "targets": ["mlp.*"], "layers": "1"},
        {"name": "down_in", "format": "nvfp4", "targets": ["down_proj"], "tensors": ["input"]},
    ]})
    table = resolve_quant_rules(policy.quantize, qwen_sites(2))
    assert table[("model.layers.0.self_attn.q_proj", "weight")][1].name == "all"
    assert table[("model.layers.1.mlp.up_proj", "weight")] == (1, policy.quantize[1])
    assert table[("model.layers.1.mlp.up_proj", "input")][1].name == "all"  # rule 1 left inputs alone
    assert table[("model.layers.0.mlp.down_proj", "input")][1].name == "down_in"
    assert table[("model.layers.0.mlp.down_proj", "weight")][1].name == "all"
    assert not any(site == "lm_head" for site, _ in table)
    assert not any(site.endswith("norm") for site, _ in table)


def test_noise_multiplier_for_combines_layer_and_selector_multipliers():
    policy = Policy.model_validate({"noise": {
        "schedule": {"sigma_start": 0.01, "sigma_end": 0.001, "total_steps": 100},
        "layer_multipliers": {"1": 1.5, 2: 2.0},
        "multipliers": [{"targets": ["input_layernorm"], "layers": "1-2", "value": 3.0}],
    }})
    by_name = {s.name: s for s in qwen_sites(3)}
    assert policy.noise.multiplier_for(by_name["model.layers.0.input_layernorm"]) == 1.0
    assert policy.noise.multiplier_for(by_name["model.layers.1.input_layernorm"]) == pytest.approx(4.5)
    assert policy.noise.multiplier_for(by_name["model.layers.2.input_layernorm"]) == pytest.approx(6.0)
    assert policy.noise.multiplier_for(by_name["model.norm"]) == 1.0


def test_real_site_class_fits_the_protocol():
    site = Site("model.layers.5.mlp.up_proj", "Linear", "linear", 5, "up")
    assert Selector.compile(["up_proj"], layers="5").matches(site)
    assert not Selector.from_section(Policy.model_validate({"quantize": [{"format": "int4", "layers": "4"}]}).quantize[0]).matches(site)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(a+)+", "nested quantifiers"),
        ("(a+?)*", "nested quantifiers"),  # lazy repeats count too
        ("(a{2})+", "nested quantifiers"),  # any inner repeat of more than one
        ("(?:a*){2}", "nested quantifiers"),  # any outer repeat of more than one
        ("x{2}y{2}z{2}w{2}v{2}", "5 repeats"),
        ("(?:.*a.*b.*c)?.*d.*e", "5 repeats"),  # repeats inside an optional group count
        ("(?:x(a*)y){2,}", "nested quantifiers"),  # through a group inside the outer repeat
        ("(a|aa)*", "an alternation inside a repeat"),
        ("((?=a.*)b)+", "nested quantifiers"),  # through a lookahead
        ("(?>a+)+", "nested quantifiers"),  # through an atomic group
        ("(a)\\1", "backreferences"),
        ("(a)?(?(1)b|c)", "backreferences"),
        (".*a.*b.*c.*d.*e", "5 repeats"),
        ("(?=.*a)(?=.*b)(?=.*c)(?=.*d).*", "5 repeats"),  # repeats inside lookaheads count
        ("(?:.*a|.*b|.*c)(?:.*d|.*e)", "5 repeats"),  # every branch counts
        ("(?>.*a)(?>.*b)(?>.*c)(?>.*d)(?>.*e)", "5 repeats"),
        ("(x.*a)(x.*b)(x.*c)(x.*d)(x.*e)", "5 repeats"),
        pytest.param("a" * 1001, "regular expression of 1001 characters", id="too-long"),
        ("a{2", None),  # accepted by the parser as a literal: no error
        ("(", "invalid regular expression"),
    ],
)
def test_regex_guard_refuses_backtracking_patterns_before_they_run(pattern, message):
    if message is None:
        assert compile_entry("re:" + pattern).regex is not None
        return
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        compile_entry("re:" + pattern)


@pytest.mark.parametrize(
    "pattern",
    [".*a.*b.*c.*d", "(a+)?", "(a?)+", "(?:ab)+", "[ab]+", "(a{1}b)+", "(?=.*a)x.*",
     "(?:.*a|b)c", "(?>a)+", "a?b?c?d?e?.*", pytest.param("a" * 1000, id="longest")],
)
def test_regex_guard_accepts_bounded_patterns(pattern):
    """At most 4 repeats; a repeat of at most one (`?`, `{1}`) is no repeat; no repeat inside."""
    assert compile_entry("re:" + pattern).regex.pattern == pattern


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty layer spec; write e.g. '10-17,20'"),
        ("   ", "empty layer spec; write e.g. '10-17,20'"),
        pytest.param("1," * 5000 + "1", "layer spec of 10001 characters; write ranges such as '10-17,20'", id="long"),
        ("1,x9", "cannot read layer range 'x9'; write e.g. '10-17,20'"),
        pytest.param("1" * 19, f"layer index in '{'1' * 19}' is too large; models have at most {10**18 - 1} layers", id="big"),
        pytest.param("0-" + "1" * 19, f"layer index in '0-{'1' * 19}' is too large; models have at most {10**18 - 1} layers", id="big-hi"),
        ("5-3", "layer range '5-3' runs backwards; write 3-5"),
        pytest.param("1" * 45, f"layer index in '{'1' * 40}' is too large; models have at most {10**18 - 1} "
                     "layers", id="big-cut"),  # the item is cut at 40 characters
        ("1,9-" + "x" * 50, f"cannot read layer range '9-{'x' * 38}'; write e.g. '10-17,20'"),  # cut at 40
    ],
)
def test_layer_spec_errors_name_the_item(spec, message):
    with pytest.raises(ValueError) as err:
        parse_layers(spec)
    assert str(err.value) == message
    assert set(parse_layers("1," * 4999 + "10")) == {1, 10}  # 10000 characters: still read


def test_layer_ranges_merge_and_format():
    layers = parse_layers("7,1-3,4,9-9,8,20-21," + "9" * 18)
    assert layers.ranges == ((1, 4), (7, 9), (20, 21), (10**18 - 1, 10**18 - 1))
    assert len(layers) == 4 + 3 + 2 + 1
    assert format_layers(layers) == "1-4,7-9,20-21," + "9" * 18
    assert parse_layers("2-6,3-4").ranges == ((2, 6),)  # contained ranges do not shrink the union
    assert format_layers([5, 1, 2, 3, 3, 9, 10]) == "1-3,5,9-10"  # any iterable, duplicates
    assert format_layers([]) == "" and format_layers(iter([4])) == "4"
    assert 0 not in layers and 1 in layers and 5 not in layers and "1" not in layers


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("", "empty selector entry"),
        ("  ", "empty selector entry"),
        ("lm_head ", "selector entry has leading or trailing spaces"),
        ("re:", "empty regular expression after 're:'"),
        ("re:[abc", "invalid regular expression"),
        ("re:(?<=a|bc)d", "invalid regular expression: look-behind requires fixed-width pattern"),
    ],
)
def test_bad_entry_messages(entry, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        compile_entry(entry)


def test_is_class_entry_and_entry_kinds_keep_their_text():
    assert [is_class_entry(t) for t in ("Linear", "linear", "Lin.ear", "L*", "_X", "X1")] == [
        True, False, False, False, False, True]
    for text, kind in (("re:a.b", "regex"), ("RMSNorm", "class"), ("mlp.*", "glob")):
        entry = compile_entry(text)
        assert (entry.text, entry.kind) == (text, kind)
    assert compile_entry("re:a.b").regex.fullmatch("axb")


def test_regex_guard_messages_say_what_to_write_instead():
    messages = {}
    for pattern in ("(a+)+", "(ab|c)*", "(a)\\1", ".*.*.*.*.*"):
        with pytest.raises(ValueError) as err:
            compile_entry("re:" + pattern)
        messages[pattern] = str(err.value)
    assert messages == {
        "(a+)+": "nested quantifiers such as (a+)+ can take exponential time; write the pattern "
                 "without a repeat inside a repeat",
        "(ab|c)*": "an alternation inside a repeat such as (a|aa)* can take exponential time; use a "
                  "character class or drop the repeat",
        "(a)\\1": "backreferences are not allowed in selectors; match the name directly",
        ".*.*.*.*.*": "5 repeats (such as .* or +) in one pattern; each multiplies the matching time: "
                      "use at most 4",
    }
