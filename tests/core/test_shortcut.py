"""The shortcut of a transformed forward (core/shortcut.py): sites whose one insertion is a cached
weight compute `linear(x, cached, bias)` without the module call, their weights checked at the
model's entry. Each test compares with the same model whose fake quantizers keep no cache (they
quantize the weight at every call: every write is seen at once), bit for bit, or counts calls."""

from __future__ import annotations

import copy
import sys
from collections import Counter

import pytest
import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList

import qtransform
from qtransform.core import versions
from qtransform.core.shortcut import ShortcutForward
from qtransform.core.versions import Watch
from qtransform.models import build_tiny
from qtransform.passes.fake_quant import FakeQuantize

W4 = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}


def _model() -> nn.Module:
    return qtransform.transform(build_tiny("qwen2", vocab=128), W4)


def _uncached(model: nn.Module) -> nn.Module:
    """A copy whose fake quantizers quantize at every call: the graph path, no cache to miss."""
    copy_ = copy.deepcopy(model)
    for m in copy_.modules():
        if isinstance(m, FakeQuantize):
            m.cache = False
    return copy_


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))


def _q(model: nn.Module, layer: int = 1) -> nn.Linear:
    return model.model.layers[layer].self_attn.q_proj


class _Calls:
    """Counts the Python calls of the given functions (a profiler, nothing replaced)."""

    def __init__(self, *functions):
        self.codes = {f.__code__: f.__qualname__ for f in functions}
        self.counts: Counter[str] = Counter()

    def __enter__(self):
        def profile(frame, event, arg):
            if event == "call" and frame.f_code in self.codes:
                self.counts[self.codes[frame.f_code]] += 1
        sys.setprofile(profile)
        return self.counts

    def __exit__(self, *exc):
        sys.setprofile(None)


def test_every_linear_of_a_w4a16_model_takes_the_shortcut():
    model = _model()
    sites = [m for m in model.modules() if hasattr(m, "weight_fake_quant")]
    assert sites and all(isinstance(m.__dict__["forward"], ShortcutForward) for m in sites)


def test_a_forward_with_unchanged_weights_checks_each_weight_once_and_calls_no_quantizer():
    """The weight checks counted: outside a rollout block each forward checks each cached weight
    once (at its entry) and reads none of them; a generate() call checks them at its first
    forward only; no fake quantizer runs as a module."""
    model = _model()
    ids = _ids()
    n = sum(isinstance(m, FakeQuantize) for m in model.modules())
    with torch.no_grad():
        model(ids)  # fills the caches
        before = versions.bytes_hashed()
        with _Calls(Watch.changed, FakeQuantize.forward) as calls:
            model(ids)
            model(ids)
        assert calls == {"Watch.changed": 2 * n}
        with _Calls(Watch.changed, FakeQuantize.forward) as calls:
            model.generate(ids, max_new_tokens=6, do_sample=False)  # 6 forwards, one block
        assert calls == {"Watch.changed": n}
    assert versions.bytes_hashed() == before


def test_the_shortcut_gives_the_graphs_values_bit_for_bit():
    model = _model()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, _uncached(model)(ids).logits)
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    ref = _uncached(model).generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
    assert torch.equal(torch.stack(gen.logits), torch.stack(ref.logits))


def _torch_write(q: nn.Linear) -> None:
    with torch.no_grad():
        q.weight.mul_(-1.5)  # the version counter moves


def _data_assign(q: nn.Linear) -> None:
    q.weight.data = -1.5 * q.weight.data


def _new_parameter(q: nn.Linear) -> None:
    q.weight = nn.Parameter(-1.5 * q.weight.detach())


def _data_copy(q: nn.Linear) -> None:
    q.weight.data.copy_(-1.5 * q.weight.data)  # no counter, every element


SEEN_AT_ONCE = {"torch_write": _torch_write, "data_assign": _data_assign, "new_parameter": _new_parameter}


class _WriteAt(LogitsProcessor):
    """Writes one weight after decode step `step` of generate() (between two forwards)."""

    def __init__(self, model: nn.Module, write, step: int):
        self.model, self.write, self.step, self.calls = model, write, step, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            self.write(_q(self.model))
        return scores


def _generate(model: nn.Module, ids: torch.Tensor, write=None) -> torch.Tensor:
    procs = LogitsProcessorList([_WriteAt(model, write, 2)] if write else [])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, logits_processor=procs)
    return torch.stack(out.logits)


@pytest.mark.parametrize("write", list(SEEN_AT_ONCE))
def test_a_write_between_two_decode_steps_is_seen_at_the_next_step(write):
    model = _model()
    ids = _ids()
    _generate(model, ids)  # fills the caches
    ref = _uncached(model)
    got = _generate(model, ids, SEEN_AT_ONCE[write])
    assert torch.equal(got, _generate(ref, ids, SEEN_AT_ONCE[write]))
    assert not torch.equal(got, _generate(_uncached(_model()), ids))


def test_a_write_through_data_between_decode_steps_is_seen_by_the_next_generate_call():
    model = _model()
    ids = _ids()
    before = _generate(model, ids)
    got = _generate(model, ids, _data_copy)  # the block's decode steps keep the checked copy
    assert torch.equal(got, before)
    after = _generate(model, ids)
    assert torch.equal(after, _generate(_uncached(model), ids)) and not torch.equal(after, before)


def _write_in_forward(model: nn.Module, write) -> None:
    """A pre-hook on layer 1 that writes that layer's q_proj once, inside the next forward."""
    def hook(module, args):
        handle.remove()
        write(_q(model))
    handle = model.model.layers[1].register_forward_pre_hook(hook)


@pytest.mark.parametrize("write", list(SEEN_AT_ONCE))
def test_a_write_inside_a_forward_is_seen_by_the_sites_after_it(write):
    model, ids = _model(), _ids()
    with torch.no_grad():
        model(ids)
        ref = _uncached(model)
        _write_in_forward(model, SEEN_AT_ONCE[write])
        _write_in_forward(ref, SEEN_AT_ONCE[write])
        got = model(ids).logits
        assert torch.equal(got, ref(ids).logits)
        assert not torch.equal(got, _uncached(_model())(ids).logits)


def test_a_write_through_data_inside_a_forward_is_seen_by_the_next_forward():
    model, ids = _model(), _ids()
    with torch.no_grad():
        first = model(ids).logits
        _write_in_forward(model, _data_copy)
        assert torch.equal(model(ids).logits, first)  # checked at the entry, before the write
        again = model(ids).logits
        assert torch.equal(again, _uncached(model)(ids).logits) and not torch.equal(again, first)


def test_a_write_between_two_forwards_is_seen_by_the_next_one():
    for write in [*SEEN_AT_ONCE.values(), _data_copy]:
        model, ids = _model(), _ids()
        with torch.no_grad():
            first = model(ids).logits
            write(_q(model))
            got = model(ids).logits
            assert torch.equal(got, _uncached(model)(ids).logits) and not torch.equal(got, first)


def test_a_site_called_outside_the_models_forward_checks_its_own_weight():
    model, ids = _model(), _ids()
    q = _q(model)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        model(ids)
        first = q(x)
        _data_copy(q)
        got = q(x)
    assert torch.equal(got, _uncached(model).model.layers[1].self_attn.q_proj(x))
    assert not torch.equal(got, first)


def test_a_switch_or_a_mode_change_inside_a_rollout_block_is_seen_by_the_next_forward():
    model, ids = _model(), _ids()
    fq = _q(model).weight_fake_quant
    ref = _uncached(model)
    with torch.no_grad():
        ref.model.layers[1].self_attn.q_proj.weight_fake_quant.enabled = False
        want_off = ref(ids).logits
        ref.model.layers[1].self_attn.q_proj.weight_fake_quant.enabled = True
    with torch.no_grad(), qtransform.rollout():
        on = model(ids).logits
        fq.enabled = False
        with _Calls(FakeQuantize.forward) as calls:
            off = model(ids).logits  # switched off: the site computes with its own weight
        assert calls == {}
        fq.enabled = True
        _q(model).weight.data[3, 5] += 1.0  # one element through .data: seen after eval()
        model.eval()
        again = model(ids).logits
    assert torch.equal(off, want_off) and not torch.equal(off, on)
    with torch.no_grad():
        assert torch.equal(again, _uncached(model)(ids).logits) and not torch.equal(again, on)


def test_a_copy_and_a_pickled_model_arm_their_own_sites():
    model, ids = _model(), _ids()
    with torch.no_grad():
        want = model(ids).logits
        for other in (copy.deepcopy(model), pickle_roundtrip(model)):
            with _Calls(FakeQuantize.forward) as calls:
                other(ids)
                got = other(ids).logits
            assert torch.equal(got, want) and calls == {}


def pickle_roundtrip(model: nn.Module) -> nn.Module:
    import io

    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_a_hook_on_a_quantizer_or_a_gradient_through_the_weight_runs_the_module():
    model, ids = _model(), _ids()
    fq = _q(model).weight_fake_quant
    seen = []
    handle = fq.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert seen == [torch.Size([64, 64])]
    with _Calls(FakeQuantize.forward) as calls:
        model(ids).logits.sum().backward()  # the weights need gradients: the STE path
    assert calls["FakeQuantize.forward"] == sum(isinstance(m, FakeQuantize) for m in model.modules())
    assert _q(model).weight.grad is not None


def test_an_export_inside_a_rollout_block_after_an_eager_forward_emits_the_fake_quant_ops():
    """Sites armed by an eager forward of the block stand aside when traced (the entry drops
    what it armed): torch.export's graph holds every fake-quant op, and the block's next eager
    forward is armed again."""
    model, ids = _model(), _ids()
    n = sum(isinstance(m, FakeQuantize) for m in model.modules())
    with torch.no_grad(), qtransform.rollout():
        model(ids)  # arms every site for the block
        ep = torch.export.export(model, (ids,), kwargs={"use_cache": False})
        with _Calls(FakeQuantize.forward) as calls:
            after = model(ids).logits
    assert calls == {}
    found = [node for node in ep.graph.nodes if node.target == torch.ops.qtransform.fake_quant.default]
    assert len(found) == n
    with torch.no_grad():
        assert torch.equal(after, _uncached(model)(ids).logits)
