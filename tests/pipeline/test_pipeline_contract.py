"""The pipeline's contract, word for word: the pass registry, PassManager's order and errors, the
selection module's messages ("matches no", "did you mean", "selects no site", bad axes), the
order of quantize actions, plan() rows and transform() options.

Users act on these messages (a typo in a selector is how experiments ran without their noise), so
each is checked against the whole expected text, written out here from the model's known sites.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import qtransform
from qtransform.core.capture import capture
from qtransform.core.phase import RolloutGenerate
from qtransform.core.plan import PlanRow
from qtransform.core.program import Program
from qtransform.core.sites import Site
from qtransform.errors import UserError
from qtransform.passes.clamp import ClampPass
from qtransform.passes.fake_quant import FakeQuantPass
from qtransform.pipeline import base
from qtransform.pipeline.base import Action, Pass, register_pass, registered_passes
from qtransform.pipeline.manager import PassManager
from qtransform.pipeline.selection import check_axis, rule_label, select_sites
from qtransform.schemas import QuantRule, load_policy
from tests.conftest import ids

STANDARD = ["rotate", "aqn_noise", "fake_quant", "hw_error", "activation_noise", "clamp", "engine",
            "instrument"]  # import order of passes/
HINT_TAIL = "use -1 (the last axis, the default for activations) or -2, or drop axis (the reduction axis)"
MXFP4_DETAIL = "mxfp4 block=32, scale_rule=floor, rounding=rne"


def _policy(**sections: object) -> dict:
    return {"version": 1, **sections}


def _rule(**fields: object) -> QuantRule:
    """A validated quantize rule (mxfp4 unless told), as the passes receive it."""
    return load_policy(_policy(quantize=[{"format": "mxfp4", **fields}])).section("quantize")[0]


def _error(fn, *args: object, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.fixture(scope="module")
def llama3() -> nn.Module:
    """A 3-layer tiny llama: layers 0-2, where the last layer index differs from the second."""
    from qtransform.models import build_tiny

    return build_tiny("llama", num_layers=3)


@pytest.fixture
def fresh() -> nn.Module:
    """A new 1-layer tiny llama: PassManager.run changes the captured model itself."""
    from qtransform.models import build_tiny

    return build_tiny("llama", num_layers=1)


@pytest.fixture(scope="module")
def program3(llama3: nn.Module) -> Program:
    return capture(llama3, None)


class LinearA(nn.Linear):
    """Subclasses of nn.Linear: sites of kind linear whose class names are all close to 'LinearE'."""


class LinearB(nn.Linear):
    pass


class LinearC(nn.Linear):
    pass


class LinearD(nn.Linear):
    pass


class Unnumbered(nn.Module):
    """Five linears with no layer index in their names, of five classes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = LinearA(4, 4), LinearB(4, 4), LinearC(4, 4), LinearD(4, 4)
        self.e = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.e(self.d(self.c(self.b(self.a(x)))))


# -- the registry -----------------------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[dict]:
    """The real registry, put back as it was after the test (a test registers its own passes)."""
    saved = dict(base._REGISTRY)
    yield base._REGISTRY
    base._REGISTRY.clear()
    base._REGISTRY.update(saved)


class _Probe(Pass[object, dict]):
    """A pass configured per test: reads the clamp section, acts on one site, may fail on purpose."""

    tag = "probe"
    section = "clamp"

    def __init__(self, name: str, *, requires: tuple[str, ...] = (), provides: tuple[str, ...] = (),
                 site: str = "model.layers.0.self_attn.k_proj", fail_in: str = "",
                 error: Exception | None = None, extra: tuple[str, ...] = ()) -> None:
        self.name, self.requires, self.provides = name, requires, provides
        self.site, self.fail_in, self.error, self.extra = site, fail_in, error, extra

    def select(self, program: Program, spec: object) -> list[Action]:
        if self.fail_in == "select":
            raise self.error
        return [Action(program.sites[self.site], "output", f"{self.name}[0]", {}, extra=self.extra)]

    def build(self, program: Program, action: Action) -> nn.Module:
        if self.fail_in == "build":
            raise self.error
        if self.fail_in == "graph":  # a use before its definition: what lint exists to catch
            graph = program.site_graph(action.site.name).graph
            first, last = next(iter(graph.nodes)), list(graph.nodes)[-2]
            with graph.inserting_before(first):
                graph.call_function(torch.neg, (last,))
        return _First()


class _First(nn.Module):
    """Returns its first input: the extra values a pass asked for only travel along."""

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return x


CLAMP = _policy(clamp={"limit": 2.0, "targets": ["*.k_proj"]})


def test_registered_passes_are_the_standard_pipeline_in_import_order():
    got = registered_passes()
    assert [p.name for p in got] == STANDARD
    assert [type(p).__name__ for p in got] == ["RotatePass", "AQNNoisePass", "FakeQuantPass", "HWErrorPass",
                                               "ActivationNoisePass", "ClampPass", "EnginePass",
                                               "InstrumentPass"]


def test_register_pass_adds_a_new_pass_last_and_accepts_the_same_class_twice(registry):
    class Extra(_Probe):
        name = "extra_pass2"

    assert register_pass(Extra) is Extra
    assert register_pass(Extra) is Extra  # a module imported twice registers the same class again
    assert registry["extra_pass2"] is Extra
    assert list(registry) == [*STANDARD, "extra_pass2"]


@pytest.mark.parametrize("bad", ["Clamp", "two words", "9lives", "fake-quant"])
def test_register_pass_refuses_a_name_that_is_not_a_lower_case_identifier(registry, bad):
    cls = type("Bad", (_Probe,), {"name": bad})
    with pytest.raises(ValueError) as info:
        register_pass(cls)
    assert str(info.value) == f"pass name {bad!r} must be a lower-case identifier"
    assert list(registry) == STANDARD


def test_register_pass_refuses_a_second_class_under_a_taken_name(registry):
    class Impostor(_Probe):
        name = "clamp"

    with pytest.raises(ValueError) as info:
        register_pass(Impostor)
    assert str(info.value) == f"a pass named 'clamp' is registered already ({ClampPass})"
    assert str(info.value).endswith("(<class 'qtransform.passes.clamp.ClampPass'>)")
    assert registry["clamp"] is ClampPass


def test_registered_passes_without_any_pass_says_what_to_import(registry):
    registry.clear()
    with pytest.raises(RuntimeError) as info:
        registered_passes()
    assert str(info.value) == "no pass is registered: import qtransform (which imports qtransform.passes)"


# -- PassManager ------------------------------------------------------------------------------


def test_pass_manager_keeps_the_given_order_where_no_dependency_decides():
    """Registration order, not the alphabet: "zeta" stays before "alpha"."""
    order = PassManager([_Probe("zeta"), _Probe("alpha"), _Probe("mid", requires=("z",)),
                         _Probe("late", provides=("z",))]).order
    assert [p.name for p in order] == ["zeta", "alpha", "late", "mid"]


def test_pass_manager_names_the_cycle_from_its_first_pass():
    with pytest.raises(ValueError) as info:
        PassManager([_Probe("a", requires=("y",), provides=("x",)),
                     _Probe("b", requires=("x",), provides=("y",))])
    assert str(info.value) == "passes form a dependency cycle: a -> b"
    with pytest.raises(ValueError) as info:
        PassManager([_Probe("c", requires=("z",), provides=("x",)), _Probe("a", requires=("x",), provides=("y",)),
                     _Probe("b", requires=("y",), provides=("z",))])
    assert str(info.value) == "passes form a dependency cycle: c -> a -> b"


@pytest.mark.parametrize("hook", ["select", "build"])
def test_a_bug_in_a_pass_is_re_raised_naming_the_pass_its_hook_and_the_passes_before(fresh, hook):
    first, bad = _Probe("first"), _Probe("bad", fail_in=hook, error=KeyError("boom"))
    manager = PassManager([first, _Probe("second"), bad])
    program = capture(fresh, None)
    with pytest.raises(RuntimeError) as info:
        manager.run(program, load_policy(CLAMP))
    assert str(info.value) == f"pass 'bad' failed in {hook} (after passes ['first', 'second']): KeyError: 'boom'"
    assert isinstance(info.value.__cause__, KeyError)


def test_a_user_error_in_a_pass_passes_through_unwrapped(fresh):
    mistake = UserError("clamp: that is the user's mistake")
    manager = PassManager([_Probe("first"), _Probe("bad", fail_in="select", error=mistake)])
    with pytest.raises(UserError) as info:
        manager.run(capture(fresh, None), load_policy(CLAMP))
    assert info.value is mistake


def test_run_inserts_with_the_extra_values_and_records_plan_rows(fresh):
    """One row per insertion with the pass's own fields; the pass's default description is ""."""
    program = capture(fresh, None)
    site = "model.layers.0.self_attn.k_proj"
    PassManager([_Probe("probe", extra=("raw:input",))]).run(program, load_policy(CLAMP))
    assert program.plan_rows == [PlanRow(site, "probe", "output", "probe[0]", "")]
    (ins,) = program.insertions(pass_name="probe")
    node = next(n for n in program.site_graph(site).graph.nodes if n.name == ins.node)
    assert [str(a) for a in node.args] == ["linear", "input_1"]  # the output, then raw:input


def test_run_names_the_pass_that_left_an_invalid_graph(fresh):
    program = capture(fresh, None)
    with pytest.raises(RuntimeError) as info:
        PassManager([_Probe("ok"), _Probe("breaker", fail_in="graph")]).run(program, load_policy(CLAMP))
    assert str(info.value).startswith("pass 'breaker' left an invalid graph: ")
    assert str(info.value) == f"pass 'breaker' left an invalid graph: {info.value.__cause__}"
    assert "used before it has been defined" in str(info.value)


# -- selection: messages ----------------------------------------------------------------------


def test_rule_label_names_the_section_index_and_rule_name():
    assert rule_label("quantize", 2, "w4") == "quantize[2] 'w4'"
    assert rule_label("quantize", 0, None) == "quantize[0]"
    assert rule_label("quantize", 1, "") == "quantize[1]"


def test_layers_that_select_nothing_name_the_models_layer_range(llama3):
    plan = qtransform.plan
    assert _error(plan, llama3, _policy(quantize=[{"format": "mxfp4", "layers": "10-17"}])) == (
        "quantize[0]: layers '10-17' selects no site; the model's layers are 0-2")
    assert _error(plan, Unnumbered(), _policy(quantize=[{"format": "mxfp4", "layers": "0"}])) == (
        "quantize[0]: layers '0' selects no site; the model's layers are not numbered")


def test_a_section_that_selects_nothing_names_its_selectors_and_some_sites(llama3):
    policy = _policy(quantize=[{"format": "mxfp4", "targets": ["*.q_proj"], "ignore": ["*.q_proj"]}])
    assert _error(qtransform.plan, llama3, policy) == (
        "quantize[0]: selects no site (targets ['*.q_proj'], ignore ['*.q_proj'], layers None); the model "
        "has 22 linear/conv1d/experts sites such as model.layers.0.self_attn.q_proj, "
        "model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj")


def test_a_section_over_no_site_of_its_kinds_says_so_without_examples(program3):
    """No experts in a llama: zero candidates, and an empty target list leaves no dead entry."""
    spec = load_policy(_policy(quantize=[{"format": "mxfp4", "targets": ["Linear"]}])).section("quantize")[0]
    spec = spec.model_copy(update={"targets": []})
    assert _error(select_sites, program3, spec, "w", kinds=("experts",)) == (
        "w: selects no site (targets [], ignore [], layers None); the model has 0 experts sites")


def test_layers_that_do_select_sites_are_no_error(program3):
    got = select_sites(program3, _rule(targets=["*.k_proj"], layers="1-2"), "w", kinds=("linear",))
    assert [s.name for s in got] == ["model.layers.1.self_attn.k_proj", "model.layers.2.self_attn.k_proj"]


@pytest.mark.parametrize(("entry", "kinds", "message"), [
    # name selectors: the closest site names, or nothing when none is close
    # (difflib: down_proj first, then the *_proj names that tie, greatest first: v_, q_)
    ("*.dwn_proj", ("linear",), "'*.dwn_proj' matches no linear site; closest site names: "
     "model.layers.0.mlp.down_proj, model.layers.0.self_attn.v_proj, model.layers.0.self_attn.q_proj"),
    ("zzz", ("linear", "conv1d"), "'zzz' matches no linear/conv1d site"),
    # class selectors: "did you mean" and the model's classes here
    ("Linaer", ("linear",), "'Linaer' matches no linear site (did you mean Linear?); the model's classes here: Linear"),
    ("LlamaRMSNorn", ("linear", "norm"), "'LlamaRMSNorn' matches no linear/norm site (did you mean LlamaRMSNorm?); "
     "the model's classes here: Linear, LlamaRMSNorm"),
    ("Embedding", ("linear", "norm"), "'Embedding' matches no linear/norm site; the model's classes here: "
     "Linear, LlamaRMSNorm"),
    # a *Norm class selector is compared with the norm classes only
    ("LlamaLayerNorm", ("linear", "norm"), "'LlamaLayerNorm' matches no linear/norm site (did you mean "
     "LlamaRMSNorm?); the model's classes here: LlamaRMSNorm"),
    ("LlamaRMSNorm", ("linear",), "'LlamaRMSNorm' matches no linear site"),
])
def test_an_entry_that_matches_nothing_is_named_with_a_hint(program3, entry, kinds, message):
    assert _error(select_sites, program3, _rule(targets=[entry]), "w", kinds=kinds) == f"w: {message}"


def test_did_you_mean_offers_at_most_three_classes():
    """Five classes, four of them close to 'LinearE': the three closest, best first."""
    policy = _policy(quantize=[{"format": "mxfp4", "targets": ["LinearE"]}])
    assert _error(qtransform.plan, Unnumbered(), policy) == (
        "quantize[0]: 'LinearE' matches no linear/conv1d/experts site (did you mean Linear or LinearD or "
        "LinearC?); the model's classes here: Linear, LinearA, LinearB, LinearC, LinearD")


def test_an_ignore_entry_that_matches_nothing_is_named_by_its_rule(llama3):
    policy = _policy(quantize=[{"format": "mxfp4"}, {"format": "mxfp4", "ignore": ["lm_heads"]}])
    assert _error(qtransform.plan, llama3, policy) == (
        "quantize[1]: 'lm_heads' matches no linear/conv1d/experts site; closest site names: lm_head")


# -- selection: blocking axes -----------------------------------------------------------------


@pytest.mark.parametrize("axis", [None, -2, -1, 0, 1])
def test_check_axis_accepts_minus_two_to_one(program3, axis):
    site = program3.sites["model.layers.0.mlp.down_proj"]
    assert check_axis(axis, site, "weight", "w") is None
    assert check_axis(axis, site, "input", "w") is None


@pytest.mark.parametrize("axis", [-3, 2])
def test_check_axis_names_the_tensor_its_shape_and_the_site(program3, axis):
    site = program3.sites["model.layers.0.mlp.down_proj"]
    assert _error(check_axis, axis, site, "weight", "quantize[3]") == (
        f"quantize[3]: axis {axis} does not exist on the weight [64, 128] of model.layers.0.mlp.down_proj; "
        + HINT_TAIL)
    assert _error(check_axis, axis, site, "output", "quantize[3]") == (
        f"quantize[3]: axis {axis} does not exist on the output of model.layers.0.mlp.down_proj; " + HINT_TAIL)
    bare = Site("x.proj", "Linear", "linear", None, "other")  # no weight shape known: none shown
    assert _error(check_axis, axis, bare, "weight", "w") == (
        f"w: axis {axis} does not exist on the weight of x.proj; " + HINT_TAIL)


def test_a_quantize_rule_with_a_bad_axis_fails_in_plan_naming_the_rule(llama3):
    """The first (site, tensor) the rule selects in site order is the one named."""
    policy = _policy(quantize=[{"format": "mxfp4"}, {"format": "mxfp4", "targets": ["*.v_proj"], "axis": 2}])
    assert _error(qtransform.plan, llama3, policy) == (
        "quantize[1]: axis 2 does not exist on the weight [32, 64] of model.layers.0.self_attn.v_proj; " + HINT_TAIL)
    policy = _policy(quantize=[{"format": "mxfp4", "targets": ["*.o_proj"], "tensors": ["input"], "axis": -3}])
    assert _error(qtransform.plan, llama3, policy) == (
        "quantize[0]: axis -3 does not exist on the input of model.layers.0.self_attn.o_proj; " + HINT_TAIL)


def test_a_dead_quantize_entry_is_named_by_its_rule_index(llama3):
    policy = _policy(quantize=[{"format": "mxfp4"}, {"format": "mxfp4", "targets": ["zzz"]}])
    assert _error(qtransform.plan, llama3, policy) == "quantize[1]: 'zzz' matches no linear/conv1d/experts site"


# -- plan() and transform() -------------------------------------------------------------------


def test_plan_rows_run_in_site_order_then_weight_input_output(llama3):
    """q_proj before k_proj (the model's order, not the alphabet's), and each site's tensors as
    weight, input, output whatever order the rule lists them in; clamp's rows after fake_quant's."""
    policy = _policy(
        quantize=[{"name": "all3", "format": "mxfp4", "targets": ["*.k_proj", "*.q_proj"],
                   "tensors": ["output", "input", "weight"], "layers": "1"}],
        clamp={"limit": 2.0, "targets": ["*.k_proj"], "layers": "1"})
    q, k = "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"
    want = [PlanRow(site, "fake_quant", point, "quantize[0] 'all3'", MXFP4_DETAIL)
            for site in (q, k) for point in ("weight", "input", "output")]
    want.append(PlanRow(k, "clamp", "output", "clamp", "±2"))
    assert qtransform.plan(llama3, policy).rows == want
    program = qtransform.transform_program(llama3, policy)
    assert program.plan_rows == want  # the rows recorded while inserting: the same table


def test_plan_and_transform_run_only_the_passes_given(llama3):
    policy = _policy(quantize=[{"format": "mxfp4", "targets": ["*.k_proj"], "layers": "2"}],
                     clamp={"limit": 3.0, "targets": ["*.k_proj"], "layers": "2"})
    site = "model.layers.2.self_attn.k_proj"
    rows = qtransform.plan(llama3, policy, passes=(p for p in [ClampPass(), FakeQuantPass()])).rows
    assert rows == [PlanRow(site, "fake_quant", "weight", "quantize[0]", MXFP4_DETAIL),
                    PlanRow(site, "clamp", "output", "clamp", "±3")]
    program = qtransform.transform_program(llama3, policy, passes=iter([FakeQuantPass()]))
    assert program.plan_rows == [PlanRow(site, "fake_quant", "weight", "quantize[0]", MXFP4_DETAIL)]


def test_plan_with_example_inputs_lists_the_attention_matmul_sites_first_in_execution_order(llama3):
    policy = _policy(clamp={"limit": 2.0, "targets": ["*.k_proj"], "layers": "0"})
    plain = qtransform.plan(llama3, policy)
    whole = qtransform.plan(llama3, policy, {"input_ids": ids()})
    assert len(plain.sites) == 32 and len(whole.sites) == 35  # 3 attention sites, 3 sdpa matmuls
    assert [s.name for s in plain.sites if s.kind == "attention"] == [
        f"model.layers.{i}.self_attn" for i in range(3)]
    assert [s.name for s in whole.sites if s.kind == "matmul"] == [
        f"model.layers.{i}.self_attn.sdpa_0" for i in range(3)]
    assert [s.name for s in plain.sites if s.kind == "matmul"] == []
    assert [s.name for s in whole.sites[:2]] == ["model.layers.0.input_layernorm",
                                                 "model.layers.0.post_attention_layernorm"]


def test_transform_marks_generate_as_a_rollout_in_module_mode_only():
    from qtransform.models import build_tiny

    policy = _policy(clamp={"limit": 2.0, "targets": ["*.k_proj"]})
    out = qtransform.transform(build_tiny("llama", num_layers=1), policy)
    assert type(out).__name__ == "LlamaForCausalLM"
    assert isinstance(out.__dict__.get("generate"), RolloutGenerate)
    model = build_tiny("llama", num_layers=1)
    gm = qtransform.transform(model, policy, {"input_ids": ids()}, mode="graph", inplace=True)
    assert isinstance(gm, torch.fx.GraphModule) and type(gm).__name__ != "LlamaForCausalLM"
    assert "generate" not in model.__dict__  # the model itself (inplace) was not marked
