"""Instrument pass: taps are identities that stream float64 metrics, once per weight version."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import qtransform
from qtransform.passes.instrument import Tap, reset_taps, set_taps_enabled, tapping, taps
from tests.conftest import ids
from tests.helpers import assert_metrics, assert_untouched, metrics_f64, mxfp4_f64, snapshot

SITE = "model.layers.0.mlp.down_proj"
W4 = {"name": "w4", "targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}
W4A4 = {**W4, "tensors": ["weight", "input"]}


def _policy(*rules, instrument=None):
    policy = {"version": 1, "quantize": list(rules)}
    if instrument is not None:
        policy["instrument"] = instrument
    return policy


def _close(a: dict, b: dict, rel=1e-9):
    """Metric dicts equal up to float64 summation order (NaN equals NaN); empty ones are no match."""
    assert a.keys() == b.keys() and a
    for key in a:
        x, y = float(a[key]), float(b[key])
        assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=rel, abs=1e-300), key


def test_no_instrument_section_inserts_no_taps(tiny):
    program = qtransform.transform_program(tiny("qwen2"), _policy(W4))
    assert taps(program.module()) == [] and program.insertions(pass_name="instrument") == []


def test_taps_are_identities_enabled_or_disabled(tiny):
    model = tiny("qwen2")
    untouched = snapshot(model)
    plain = qtransform.transform(model, _policy(W4A4))
    tapped = qtransform.transform(model, _policy(W4A4, instrument={}))
    x = ids()
    with torch.no_grad():
        want = plain(input_ids=x).logits
        assert torch.equal(tapped(input_ids=x).logits, want)
        set_taps_enabled(tapped, False)
        reset_taps(tapped)
        assert torch.equal(tapped(input_ids=x).logits, want)
    assert all(t.calls == 0 and t.stats.n == 0 for t in taps(tapped))
    with tapping(tapped) as found, torch.no_grad():
        tapped(input_ids=x)
        assert all(t.calls == 1 for t in found)
    assert not any(t.enabled for t in taps(tapped))  # the flags are restored
    assert_untouched(untouched, model)


def test_weight_tap_once_per_weight_version(tiny):
    model = qtransform.transform(tiny("qwen2"), _policy(W4, instrument={"points": ["weight"]}))
    site = model.get_submodule(SITE)
    tap = site.weight_tap
    with torch.no_grad():
        site.weight[:, :16] = 0.0  # exact zeros: the deadzone counts nonzero inputs only
        model(input_ids=ids())
        first = tap.stats
        model(input_ids=ids(seed=1))
    assert tap.stats is first and tap.calls == 2
    w = site.weight.detach()
    assert_metrics(first.result(), metrics_f64(w, *mxfp4_f64(w)))
    with torch.no_grad():
        site.weight.mul_(2.0)  # an in-place write bumps the version: re-measured, not accumulated
        model(input_ids=ids())
    assert tap.stats is not first and tap.stats.n == w.numel()
    assert tap.result()["quant"]["sqnr_db"] == pytest.approx(first.result()["sqnr_db"])


def test_input_tap_equals_direct_float64_over_all_batches(tiny):
    """W16A4: streamed metrics of the quantized activation equal one computation over the
    concatenation of every batch's input (collected here with a plain forward pre-hook)."""
    a4 = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["input"]}
    model = qtransform.transform(tiny("qwen2"), _policy(a4, instrument={"targets": [SITE]}))
    site = model.get_submodule(SITE)
    seen = []
    handle = site.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        for seed in range(4):
            model(input_ids=ids(2, 5 + seed, seed=seed))
    handle.remove()
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])
    got = site.input_tap.result()["quant"]
    assert_metrics(got, metrics_f64(x, *mxfp4_f64(x)))
    assert site.weight_tap.result()["quant"] is None  # weights unquantized: nothing to measure


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_shadow_reference_is_the_original_site(tiny, arch):
    """The shadow product reproduces the original module bit for bit (Conv1D's [in, out] addmm,
    Linear with bias), so local error is the site's own error."""
    model = tiny(arch)
    name = "transformer.h.0.attn.c_attn" if arch == "gpt2" else "encoder.layer.0.attention.self.query"
    out = qtransform.transform(model, _policy({"targets": [name], "format": "mxfp4"},
                                              instrument={"targets": [name]}))
    original = model.get_submodule(name)
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        ref = out.get_submodule(name).output_tap.reference(x, original.weight, original.bias)
        assert torch.equal(ref, original(x))


def test_state_size_does_not_grow_with_batches(tiny):
    model = qtransform.transform(tiny("qwen2"), _policy(W4A4, instrument={}))

    def size() -> int:
        return sum(len(pickle.dumps((t.stats, t.local, t.exponents))) for t in taps(model))

    with torch.no_grad():
        model(input_ids=ids())
        one = size()
        for seed in range(5):
            model(input_ids=ids(seed=seed))
    assert size() == one and all(t.calls == 6 for t in taps(model))


def test_traced_taps_are_one_labelled_op_each(tiny):
    model = qtransform.transform(tiny("qwen2"), _policy(W4, instrument={"targets": [SITE]}))
    kwargs = {"input_ids": ids(), "use_cache": False}
    ep = torch.export.export(model, (), kwargs, strict=False)
    labels = sorted(n.args[1] for n in ep.graph.nodes if n.target == torch.ops.qtransform.tap.default)
    assert labels == [f"{SITE}:input", f"{SITE}:output", f"{SITE}:weight"]
    assert all(t.calls == 0 for t in taps(model))  # tracing measured nothing
    with tapping(model, False):
        ep = torch.export.export(model, (), kwargs, strict=False)
    assert not [n for n in ep.graph.nodes if n.target == torch.ops.qtransform.tap.default]


def test_graph_mode_taps_measure_what_module_mode_measures(tiny):
    model = tiny("qwen2")
    policy = _policy(W4A4, instrument={"targets": [SITE]})
    x = ids()
    program = qtransform.transform_program(model, policy, {"input_ids": x}, mode="graph")
    module = qtransform.transform(model, policy)
    with torch.no_grad():
        program.module()(input_ids=x, use_cache=False)
        module(input_ids=x)
    graph_taps = {t.label: t.result() for t in taps(program.module())}
    module_taps = {t.label: t.result() for t in taps(module)}
    assert sorted(graph_taps) == sorted(module_taps) == [f"{SITE}:{p}" for p in ("input", "output", "weight")]
    compared = []
    for label, want in module_taps.items():
        for key in ("quant", "local"):
            if want.get(key) is not None:
                _close(graph_taps[label][key], want[key], rel=1e-6)
                compared.append((label, key))
    # the quantization error at the quantized points, the local error at the output: none skipped
    assert sorted(compared) == [(f"{SITE}:input", "quant"), (f"{SITE}:output", "local"),
                                (f"{SITE}:weight", "quant")]


def test_plan_lists_taps_after_fake_quant_and_shadow_only_where_needed(tiny):
    policy = _policy({"targets": [SITE], "format": "mxfp4"},
                     instrument={"targets": [SITE, "lm_head"], "points": ["output"]})
    rows = qtransform.plan(tiny("qwen2"), policy).rows
    assert [(r.site, r.pass_name, r.detail) for r in rows] == [
        (SITE, "fake_quant", "mxfp4 block=32, scale_rule=floor, rounding=rne"),
        (SITE, "instrument", "tap + shadow"),
        ("lm_head", "instrument", "tap + shadow")]
    model = qtransform.transform(tiny("qwen2"), policy)
    head = model.get_submodule("lm_head").output_tap
    assert isinstance(head, Tap) and head.local is None  # untouched site: no shadow product
