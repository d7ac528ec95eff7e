"""Weight-change detection (core/versions.py): which writes are seen when (docs/rl.md), and that a
forward whose weights did not change reads none of them (the bytes the content hash reads are
counted, not timed)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qtransform
from qtransform.core import versions
from qtransform.core.versions import SAMPLES, Watch
from qtransform.models import build_tiny

W4 = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}


def quantized_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if hasattr(m, "weight_fake_quant"))


# -- the watch itself ---------------------------------------------------------------------------
def test_identity_and_sample_checks_read_no_byte_of_an_unchanged_tensor():
    t, w = torch.randn(256, 64), Watch()
    assert w.changed(t)  # the first look hashes it
    before = versions.bytes_hashed()
    for check in ("identity", "sample", "identity"):
        assert not w.changed(t, check)
    assert versions.bytes_hashed() == before
    assert not w.changed(t, "content") and versions.bytes_hashed() == before + t.numel() * 4


def test_each_kind_of_write_is_seen_by_the_check_that_promises_it():
    t, w = torch.randn(64, 32), Watch()
    w.changed(t)
    with torch.no_grad():
        t[5, 7] += 1  # through torch: the version counter moves
    assert w.changed(t, "identity")
    t.data[:, 0] *= 2  # a column through .data: no counter, but sampled elements change
    assert not w.changed(t, "identity") and w.changed(t, "sample")
    t.data[:] = -t.data.flip(0)  # same values, other places
    versions.recheck()  # a rollout's entry: "identity" compares the sample once
    assert w.changed(t, "identity")
    t.data[28:36] += 1  # eight whole rows: 256 elements, twice the sample's stride
    assert not w.changed(t, "identity")
    versions.recheck()
    before = versions.bytes_hashed()
    assert w.changed(t, "identity") and not w.changed(t, "identity")
    assert versions.bytes_hashed() == before + t.numel() * 4  # the change is hashed, once
    t.data.view(-1)[1] += 1  # one element, not in the sample (every 128th element)
    versions.recheck()
    assert not w.changed(t, "sample") and not w.changed(t, "identity")
    w.recheck()  # the owner's train()/eval(): every byte
    assert w.changed(t, "identity")


def test_a_new_tensor_with_the_same_bytes_is_not_a_change_and_new_bytes_are():
    t, w = torch.randn(16, 16), Watch()
    w.changed(t)
    same = t.clone()  # another object and storage (accelerate's hooks load weights like this)
    assert not w.changed(same, "identity")
    assert w.changed(torch.randn(16, 16), "identity")
    assert w.changed(torch.zeros(16, 16, dtype=torch.float16), "identity")


def test_a_storage_freed_and_filled_again_is_read_safely_and_seen():
    """FSDP2 frees an unsharded parameter's storage by resizing it to 0 and fills it again at
    the next forward: the sample's view of the old memory must not be read in between."""
    t, w = torch.randn(128, 64), Watch()
    w.changed(t)
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    assert t.data_ptr() == 0
    storage.resize_(nbytes)
    t.data.copy_(torch.ones(128, 64))
    assert w.changed(t, "sample") and not w.changed(t, "sample")


def test_copies_of_a_watch_have_seen_nothing():
    t, w = torch.randn(8, 8), Watch()
    w.changed(t)
    for other in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
        assert other.changed(t, "identity")  # said once, as for any first look
        assert not other.changed(t, "identity")


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 300), min_size=1, max_size=3), where=st.floats(0, 1),
       delta=st.sampled_from([1.0, -3.5, 1e-30]))
def test_a_write_of_any_run_of_a_sample_stride_is_seen_by_the_sample(shape, where, delta):
    """The sample holds one element in every `sample_stride(numel)` consecutive elements (at
    most SAMPLES of them), so a write through `.data` that changes such a run is seen."""
    t, w = torch.randn(shape), Watch()
    w.changed(t)
    old = t.detach().clone().view(torch.int32).reshape(-1)
    numel = t.numel()
    run = versions.sample_stride(numel)
    assert -(-numel // run) <= SAMPLES
    start = int(where * (numel - run))
    t.data.view(-1)[start:start + run] += delta
    differs = t.detach().view(torch.int32).reshape(-1) != old
    if bool(differs[start:start + run].all()):
        assert w.changed(t, "sample")
    elif not bool(differs.any()):  # 1e-30 changes no bit: nothing to see
        assert not w.changed(t, "sample")


def test_the_sample_is_compared_bit_for_bit():
    t, w = torch.zeros(10), Watch()
    w.changed(t)
    t.data[0] = -0.0  # equal as floats, another bit pattern
    assert w.changed(t, "sample")
    t.data[0] = float("nan")
    assert w.changed(t, "sample") and not w.changed(t, "sample")  # NaN is NaN: no change


def test_a_tensor_without_a_sample_is_hashed_at_each_sample_check():
    """A non-contiguous tensor has no cheap sample (the fast path's view is of another tensor or
    none): the sample check hashes it, so a lone element written through `.data` is seen."""
    base, w = torch.randn(32, 48), Watch()
    t = base.t()
    w.changed(base)  # a contiguous tensor first: its sample view must not serve `t`
    w.changed(t)
    before = versions.bytes_hashed()
    assert not w.changed(t, "sample")
    assert versions.bytes_hashed() == before + t.numel() * 4
    t.data[3, 5] += 1
    assert w.changed(t, "sample") and not w.changed(t, "identity")
    assert w.changed(base, "sample")  # back to the contiguous one: a new look, hashed
    base.data.view(-1)[: versions.sample_stride(base.numel())] += 1  # a run of the sample's stride
    assert w.changed(base, "sample") and not w.changed(base, "sample")


# -- a transformed model: bytes read per forward --------------------------------------------
def test_a_forward_with_unchanged_weights_reads_none_of_them():
    model = qtransform.transform(build_tiny("qwen2", vocab=128), W4)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        model(ids)  # fills the caches
        before = versions.bytes_hashed()
        model(ids)
        model(ids)
        model.generate(ids, max_new_tokens=6, do_sample=False)  # 7 forwards
        assert versions.bytes_hashed() == before
    model.train()  # a mode switch reads each weight once more, at the next forward
    before = versions.bytes_hashed()
    model(ids).logits.sum().backward()
    model(ids)
    assert versions.bytes_hashed() - before == quantized_weight_bytes(model)


# -- a transformed model: each kind of write in each context ------------------------------------
def _fresh(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)  # the copies' caches start empty (their watches have seen nothing)


def _eval_forward(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _generate(model, ids):
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return torch.stack(out.logits)


def _rollout_block(model, ids):
    with torch.no_grad(), qtransform.rollout():
        return model(ids).logits


def _train_step(model, ids):
    model.train()  # as HF's Trainer does at every step
    return model(ids).logits.detach()


CONTEXTS = {"eval_forward": _eval_forward, "generate": _generate, "rollout_block": _rollout_block,
            "train_step": _train_step}


def _write(model: nn.Module, kind: str) -> None:
    q = model.model.layers[1].self_attn.q_proj
    torch.manual_seed(5)
    if kind == "optimizer_step":
        q.weight.grad = torch.randn_like(q.weight)
        torch.optim.AdamW([q.weight], lr=1e-2).step()
        q.weight.grad = None
    elif kind == "data_copy":
        q.weight.data.copy_(torch.randn_like(q.weight))
    elif kind == "data_add_low_rank":  # what PEFT's merge does
        q.weight.data += torch.randn(64, 2) @ torch.randn(2, 64)
    elif kind == "data_assign":
        q.weight.data = torch.randn_like(q.weight)
    elif kind == "new_parameter":
        q.weight = nn.Parameter(torch.randn_like(q.weight))
    elif kind == "one_element_through_data":
        q.weight.data[3, 5] += 1.0
    else:
        raise AssertionError(kind)


WRITES = ["optimizer_step", "data_copy", "data_add_low_rank", "data_assign", "new_parameter",
          "one_element_through_data"]


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("write", WRITES)
def test_each_write_is_seen_in_each_context(write, context):
    """Run the context (filling the caches), write one weight, run it again: the result equals a
    fresh copy's, bit for bit. A lone element written through `.data` is the one write the
    sample can miss: it is seen after a train()/eval() call, which the training step makes."""
    if write == "one_element_through_data" and context != "train_step":
        pytest.skip("seen after the next train()/eval() call: test below")
    model = qtransform.transform(build_tiny("qwen2", vocab=128), W4)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    run = CONTEXTS[context]
    first = run(model, ids)
    _write(model, write)
    got = run(model, ids)
    assert not torch.equal(got, first)
    assert torch.equal(got, run(_fresh(model), ids))


def test_a_lone_element_written_through_data_is_seen_after_eval():
    model = qtransform.transform(build_tiny("qwen2", vocab=128), W4)
    ids = torch.randint(0, 128, (2, 5))
    first = _eval_forward(model, ids)
    _write(model, "one_element_through_data")
    model.eval()
    got = _eval_forward(model, ids)
    assert not torch.equal(got, first) and torch.equal(got, _eval_forward(_fresh(model), ids))


def test_peft_merge_and_unload_between_generate_calls_is_seen():
    peft = pytest.importorskip("peft")
    model = qtransform.transform(build_tiny("qwen2", vocab=128), W4)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    ids = torch.randint(0, 128, (1, 5))
    _generate(lora, ids)
    with lora.disable_adapter():
        stale = _generate(lora, ids)  # what a cache that missed the merge would give
    merged = lora.merge_and_unload()
    with torch.no_grad():
        got = merged(ids).logits  # a plain forward right after the merge
    assert torch.equal(got, _fresh(merged)(ids).logits)
    assert torch.equal(_generate(merged, ids), _generate(_fresh(merged), ids))
    assert not torch.equal(_generate(merged, ids), stale)


def test_an_optimizer_step_requantizes_without_reading_the_weights_first():
    """A step writes through torch (version counters move): the next forward quantizes the new
    weights, equal to a fresh transform of them, and hashes no byte on the way."""
    model = qtransform.transform(build_tiny("qwen2", vocab=128), W4).train()
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, use_cache=False).logits.square().mean().backward()
    opt.step()
    before = versions.bytes_hashed()
    with torch.no_grad():
        out = model(ids, use_cache=False).logits
    assert versions.bytes_hashed() == before
    plain = build_tiny("qwen2", vocab=128)
    plain.load_state_dict(model.state_dict())
    fresh = qtransform.transform(plain, W4)
    with torch.no_grad():
        assert torch.equal(out, fresh(ids, use_cache=False).logits)
