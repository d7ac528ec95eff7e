"""transform(): fake-quant in module and graph mode, API preservation, cache, gradients, plans."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtransform
from qtransform import fake_quantize
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.passes.fake_quant import FakeQuantize
from tests.conftest import ids
from tests.helpers import assert_untouched, snapshot

W4A16 = {"version": 1, "quantize": [
    {"name": "w4", "targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight"]}]}

ALL_LINEARS = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp4"}]}


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}


def _reference(model, skip=("lm_head",), fmt="mxfp4", **opts):
    """The same model with quantized weights written in: what fake-quant must compute."""
    ref = copy.deepcopy(model)
    for name, mod in _linears(ref).items():
        if name in skip:
            continue
        axis = 0 if type(mod).__name__ == "Conv1D" else -1
        with torch.no_grad():
            mod.weight.copy_(fake_quantize(mod.weight, fmt, axis=axis, **opts))
    return ref


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gpt2", "bert"])
def test_w4a16_equals_quantized_weights_and_keeps_api(tiny, arch):
    model = tiny(arch)
    before = snapshot(model)
    policy = W4A16 if arch != "bert" else ALL_LINEARS  # BERT has no lm_head: ignoring it is an error
    out = qtransform.transform(model, policy)
    assert type(out) is type(model) and out is not model
    assert list(out.state_dict()) == list(model.state_dict())
    x = ids()
    with torch.no_grad():
        got = out(input_ids=x)[0]
        want = _reference(model, skip=("lm_head",) if arch != "bert" else ())(input_ids=x)[0]
        plain = model(input_ids=x)[0]
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)
    assert_untouched(before, model)  # the caller's model: structure, hooks, flags, values
    n_quantized = len([n for n in _linears(model) if n != "lm_head"])
    assert len([i for i in qtransform.insertion_log(out) if i.pass_name == "fake_quant"]) == n_quantized


def test_bf16_and_generate(tiny):
    model = tiny("qwen2", dtype=torch.bfloat16)
    out = qtransform.transform(model, W4A16)
    x = ids(1, 5)
    with torch.no_grad():
        got = out(input_ids=x).logits
        want = _reference(model)(input_ids=x).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    gen = out.generate(x, max_new_tokens=4, do_sample=False)
    ref = _reference(model).generate(x, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 9) and torch.equal(gen, ref)


def test_input_quantization_w16a4(tiny):
    model = tiny("llama")
    policy = {"version": 1, "quantize": [{"targets": ["model.layers.0.mlp.down_proj"], "format": "mxfp4",
                                          "tensors": ["input"]}]}
    out = qtransform.transform(model, policy)
    site = out.model.layers[0].mlp.down_proj
    x = torch.randn(2, 3, 128)
    with torch.no_grad():
        assert torch.equal(site(x), F.linear(fake_quantize(x, "mxfp4"), model.model.layers[0].mlp.down_proj.weight))


def test_later_rule_overrides_earlier_for_same_site_and_tensor(tiny):
    model = tiny("qwen2")
    policy = {"version": 1, "quantize": [
        {"name": "all", "targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"},
        {"name": "down8", "targets": ["*.down_proj"], "format": "mxfp8_e4m3"}]}
    plan = qtransform.plan(model, policy)
    rows = {r.site: r for r in plan.rows}
    assert rows["model.layers.0.mlp.down_proj"].rule == "quantize[1] 'down8'"
    assert rows["model.layers.0.mlp.up_proj"].rule == "quantize[0] 'all'"
    assert "lm_head" not in rows and plan.for_site("lm_head") == []
    assert "lm_head" in plan.to_text() and "(none)" in plan.to_text()
    out = qtransform.transform(model, policy)
    w = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        assert torch.equal(out.model.layers[1].mlp.down_proj.weight_fake_quant(w), fake_quantize(w, "mxfp8_e4m3"))


def test_unmatched_entries_are_errors_with_suggestions_and_leave_model_untouched(tiny):
    model = tiny("qwen2")
    before = snapshot(model)
    bad = {"version": 1, "quantize": [{"targets": ["model.layers.*.mlp.down_prj"], "format": "mxfp4"}]}
    with pytest.raises(UserError, match=r"down_prj.*closest site names: model\.layers\.\d\.mlp\.down_proj"):
        qtransform.transform(model, bad)
    typo_ignore = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_haed"], "format": "mxfp4"}]}
    with pytest.raises(UserError, match="lm_haed.*lm_head"):
        qtransform.transform(model, typo_ignore)
    no_layers = {"version": 1, "quantize": [{"targets": ["Linear"], "layers": "10-17", "format": "mxfp4"}]}
    with pytest.raises(UserError, match=r"layers '10-17' selects no site; the model's layers are 0-1"):
        qtransform.transform(model, no_layers)
    assert_untouched(before, model)


def test_weight_cache_requantizes_after_optimizer_step_and_gradients_reach_parameter(tiny):
    model = qtransform.transform(tiny("qwen2"), W4A16).train()
    site = model.model.layers[0].mlp.up_proj
    fq = site.weight_fake_quant
    x = ids()
    model(input_ids=x).logits.sum().backward()
    first = fq._cached
    assert site.weight.grad is not None and site.weight.grad.abs().sum() > 0
    model(input_ids=x)
    assert fq._cached is first  # unchanged weight: not re-quantized
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.step()
    model(input_ids=x)
    assert fq._cached is not first
    assert torch.equal(fq._cached, fake_quantize(site.weight.detach(), "mxfp4"))


def test_ste_gradient_equals_gradient_through_quantized_weight():
    lin = nn.Linear(64, 8)
    model = qtransform.transform(nn.Sequential(lin), {"version": 1, "quantize": [
        {"targets": ["Linear"], "format": "nvfp4"}]})
    x = torch.randn(4, 64)
    model(x).pow(2).sum().backward()
    wq = fake_quantize(lin.weight.detach(), "nvfp4").requires_grad_(True)
    F.linear(x, wq, lin.bias).pow(2).sum().backward()
    assert torch.equal(model[0].weight.grad, wq.grad)


def test_inplace_transforms_the_given_model(tiny):
    model = tiny("qwen2")
    weight = model.model.layers[0].mlp.up_proj.weight
    out = qtransform.transform(model, W4A16, inplace=True)
    assert out is model and out.model.layers[0].mlp.up_proj.weight is weight


def test_torch_export_shows_one_fake_quant_node_per_site(tiny):
    out = qtransform.transform(tiny("qwen2"), W4A16)
    ep = torch.export.export(out, (), {"input_ids": ids(), "use_cache": False}, strict=False)
    nodes = [n for n in ep.graph.nodes if n.target == torch.ops.qtransform.fake_quant.default]
    labels = sorted(n.args[3] for n in nodes)
    assert len(nodes) == 14
    assert labels[0] == "model.layers.0.mlp.down_proj/weight_fake_quant"


def test_graph_mode_runs_the_same_pass_on_the_whole_model_graph(tiny):
    model = tiny("qwen2")
    x = ids()
    program = qtransform.transform_program(model, W4A16, {"input_ids": x}, mode="graph")
    gm = program.module()
    assert len(program.insertions(pass_name="fake_quant")) == 14
    with torch.no_grad():
        got = gm(input_ids=x, use_cache=False).logits
        want = qtransform.transform(model, W4A16)(input_ids=x).logits
    assert torch.equal(got, want)


def test_save_pretrained_and_reload_from_local_folder(tiny, tmp_path):
    model = tiny("qwen2")
    out = qtransform.transform(model, W4A16)
    out.save_pretrained(tmp_path / "m")
    reloaded = qtransform.models.load_model(tmp_path / "m")
    want, got = model.state_dict(), reloaded.state_dict()
    assert list(got) == list(want) and all(torch.equal(want[k], got[k]) for k in want)
    again = qtransform.transform(reloaded, W4A16)
    x = ids()
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, out(input_ids=x).logits)


def test_hub_id_without_network_is_a_clear_error():
    with pytest.raises(UserError, match="hub ids are not downloaded"):
        qtransform.models.load_model("Qwen/Qwen2.5-0.5B")


def test_plain_torch_mlp():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    out = qtransform.transform(mlp, {"version": 1, "quantize": [{"targets": ["Linear"], "format": "int4",
                                                                  "block_size": 32}]})
    x = torch.randn(3, 32)
    ref = _reference(mlp, skip=(), fmt="int4", block_size=32)
    with torch.no_grad():
        assert torch.equal(out(x), ref(x))


def test_to_dtype_requantizes_and_ddp_wraps_the_transformed_model(tiny, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny("qwen2")
    out = qtransform.transform(model, W4A16)
    x = ids()
    with torch.no_grad():
        out(input_ids=x)  # cache fp32 weights
        got = out.to(torch.bfloat16)(input_ids=x).logits
        want = _reference(model.to(torch.bfloat16))(input_ids=x).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DDP(out.float().train())
        ddp(input_ids=x).logits.sum().backward()
        assert out.model.layers[0].mlp.up_proj.weight.grad is not None
    finally:
        dist.destroy_process_group()


class _BranchyLinear(nn.Linear):
    """A Linear subclass whose forward cannot be symbolically traced (data-dependent branch)."""

    def forward(self, x):
        if x.abs().max() > 1e6:
            x = x.clamp(-1e6, 1e6)
        return F.linear(x, self.weight, self.bias)


def test_untraceable_site_modules_get_opaque_graphs_with_the_same_keys():
    import transformers as tf

    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1,
                                                  num_heads=2, d_kv=16)).eval()
    policy = {**W4A16, "noise": {"schedule": {"kind": "constant", "sigma_start": 0.1, "total_steps": 10},
                                       "apply_during": "both"}}
    out = qtransform.transform(t5, policy)
    assert list(out.state_dict()) == list(t5.state_dict())
    x = ids(2, 5, vocab=64)
    controller = qtransform.noise_controller(out)
    controller.set_step(5)
    with torch.no_grad():
        noisy = out(input_ids=x, decoder_input_ids=x).logits
        with controller.disabled():
            clean = out(input_ids=x, decoder_input_ids=x).logits
        want = _reference(t5)(input_ids=x, decoder_input_ids=x).logits  # lm_head is tied: kept
    assert torch.equal(clean, want) and not torch.equal(noisy, clean)

    torch.manual_seed(0)
    mlp = nn.Sequential(_BranchyLinear(32, 16))
    q = qtransform.transform(mlp, {"version": 1, "quantize": [{"targets": ["Linear"], "format": "nvfp4",
                                                               "tensors": ["weight", "input"],
                                                               "global_scale": "tensor"}]})
    v = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(q(v), F.linear(fake_quantize(v, "nvfp4"), fake_quantize(mlp[0].weight, "nvfp4"), mlp[0].bias))
    assert list(q.state_dict()) == ["0.weight", "0.bias"]


def test_content_hash_reads_cpu_bytes_without_freezing_the_storage():
    """FSDP2 frees and re-allocates unsharded parameters by resizing their storage; the weight
    cache's hash must read the bytes without making that storage non-resizable (numpy does)."""
    import xxhash

    from qtransform.core.versions import Watch, content_hash

    t = torch.randn(6, 5)
    assert content_hash(t) == xxhash.xxh3_64_intdigest(t.clone().numpy().tobytes())
    assert Watch().changed(t, "content")
    t.untyped_storage().resize_(0)  # raises if the key had frozen the storage
    assert t.untyped_storage().size() == 0


def test_fake_quantize_module_repr_copy_cache_and_step():
    """FakeQuantize's small API against formats.fake_quantize and core.streams.site_seed."""
    from qtransform.core.streams import site_seed
    from qtransform.passes.fake_quant import FakeQuantize

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    cfg = QuantConfig.from_options
    fq = FakeQuantize(cfg("mxfp4", {"block_size": 32, "nvfp4_variant": None}), "lin/weight_fake_quant", cache=True)
    assert fq.extra_repr() == "mxfp4, block_size=32, axis=-1, scale_rule=floor, rounding=rne, label='lin/weight_fake_quant'"
    assert FakeQuantize(cfg("nvfp4", {"axis": 0}), "a/input_fake_quant").extra_repr() == \
        "nvfp4, block_size=16, axis=0, rounding=rne, nvfp4_variant=default, label='a/input_fake_quant'"
    want = fake_quantize(x, "mxfp4", block_size=32)
    fq.enabled = False  # the copy is quantized whether or not the module is enabled
    copy_ = fq.quantized_copy(x.clone().requires_grad_(True))
    assert torch.equal(copy_, want) and not copy_.requires_grad and copy_.grad_fn is None
    fq.enabled = True
    assert torch.equal(fq(x), want) and torch.equal(fq._cached, want)
    fq.clear_cache()
    assert fq._cached is None
    fq.set_step(4)  # no stream: nothing to move, nothing raised
    sr = FakeQuantize(cfg("mxfp4", {"rounding": "stochastic", "seed": 9}), "s/weight_fake_quant")
    sr.set_step(5, 2)  # step 5, two draws already taken: this forward is draw 2
    got = sr.quantize(x)
    assert (sr.stream.step, sr.stream.count) == (5, 3)
    assert torch.equal(got, fake_quantize(x, "mxfp4", rounding="stochastic",
                                          seed=site_seed(9, "s/weight_fake_quant", 5, 2)))
    sr.set_step(6)  # a new step starts at draw 0
    assert torch.equal(sr.quantize(x), fake_quantize(x, "mxfp4", rounding="stochastic",
                                                     seed=site_seed(9, "s/weight_fake_quant", 6, 0)))


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_fp8_per_channel_weights_and_per_token_inputs(tiny, arch):
    """FP8_DYNAMIC-style rules: each weight is quantized per output channel (GPT-2's Conv1D
    stores [in, out]: its channels are columns), each input per token; plans say so in words."""
    model = tiny(arch)
    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head"], "format": "fp8_e4m3", "granularity": "channel"},
        {"targets": ["Linear"], "ignore": ["lm_head"], "format": "fp8_e4m3", "granularity": "token",
         "tensors": ["input"]}]}
    details = {r.detail for r in qtransform.plan(model, policy).rows}
    assert details == {"fp8_e4m3 per channel, rounding=rne, scale_dtype=float32",
                       "fp8_e4m3 per token, rounding=rne, scale_dtype=float32"}
    out = qtransform.transform(model, policy)
    name, mod = next((n, m) for n, m in _linears(model).items() if n != "lm_head")
    site = out.get_submodule(name)
    conv = type(mod).__name__ == "Conv1D"
    x = torch.randn(2, 3, mod.weight.shape[0 if conv else 1])
    w = fake_quantize(mod.weight, "fp8_e4m3", granularity="channel", axis=0 if conv else -1)
    xq = fake_quantize(x, "fp8_e4m3", granularity="token")
    want = xq @ w + mod.bias if conv else F.linear(xq, w, mod.bias)
    with torch.no_grad():
        assert torch.equal(site(x), want)
    if not conv:  # one scale per row: each row of the quantized weight is the row quantized alone
        row = fake_quantize(mod.weight[3:4], "fp8_e4m3", granularity="channel")
        assert torch.equal(w[3:4], row)


def test_a_block_longer_than_a_sites_axis_is_refused_at_plan_time(tiny):
    """The issue's int8 block of 2^33 used to run as per-row quantization; now plan and
    transform refuse it, naming the rule, the site, the axis length and the fix."""
    model = tiny("qwen2")
    before = snapshot(model)
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "int8", "block_size": 2**33}]}
    message = ("quantize[0] at model.layers.0.self_attn.q_proj (weight): int8: block_size 8589934592 "
               "is longer than axis 1 of a tensor of shape [64, 64] (64 elements); use a block of at "
               "most 64, or granularity 'channel' (weights) / 'token' (activations) for one scale "
               "per whole row")
    for call in (qtransform.plan, qtransform.transform):
        with pytest.raises(UserError) as err:
            call(model, policy)
        assert str(err.value) == message
    inputs = {"version": 1, "quantize": [{"targets": ["*.down_proj"], "format": "fp8_e4m3",
                                          "tensors": ["input"], "block_size": 256}]}
    with pytest.raises(UserError, match=r"down_proj \(input\): fp8_e4m3: block_size 256 is longer than "
                                        r"axis 0 of a tensor of shape \[128\]"):
        qtransform.plan(model, inputs)
    assert_untouched(before, model)


def test_fake_quantize_module_takes_a_given_amax(tiny):
    """`FakeQuantize.quantize(x, amax=)`: what fused and calibrated scales call. One amax for a
    weight; for a fused experts weight [E, ...] one shared amax or one per expert ([E])."""
    model = tiny("qwen2")
    out = qtransform.transform(model, {"version": 1, "quantize": [
        {"targets": ["*.q_proj"], "format": "nvfp4"}]})
    fq = out.model.layers[0].self_attn.q_proj.weight_fake_quant
    w = model.model.layers[0].self_attn.q_proj.weight.detach()
    fused = torch.tensor(3.5)
    assert torch.equal(fq.quantize(w, amax=fused), fake_quantize(w, "nvfp4", amax=fused))
    assert not torch.equal(fq.quantize(w, amax=fused), fq.quantize(w))
    experts = FakeQuantize(QuantConfig.from_options("nvfp4", {}), "e/weight_fake_quant", per_expert=True)
    x = torch.randn(3, 8, 32)
    each = torch.tensor([1.0, 2.0, 40.0])
    assert torch.equal(experts.quantize(x, amax=each),
                       torch.stack([fake_quantize(x[e], "nvfp4", amax=each[e]) for e in range(3)]))
    assert torch.equal(experts.quantize(x, amax=fused),
                       torch.stack([fake_quantize(x[e], "nvfp4", amax=fused) for e in range(3)]))
