"""share_scale: NVFP4 weights with one global scale per group (fused siblings or explicit groups).

The reference is what a serving stack computes: the fused matrix (q, k and v stacked along the
output rows, as vLLM's qkv_proj holds them) quantized as one tensor, so its global scale comes
from the largest amax of the group; each member's rows are then its quantized weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import qtransform
from qtransform import fake_quantize
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.schemas import PolicyError, load_policy
from tests.conftest import ids

FUSED = {"version": 1, "quantize": [
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "share_scale": "fused"}]}


def fused_reference(weights: list[torch.Tensor], **opts) -> list[torch.Tensor]:
    """Each weight's rows of the stacked matrix quantized as one tensor."""
    q = fake_quantize(torch.cat([w.detach() for w in weights]), "nvfp4", **opts)
    return list(q.split([w.shape[0] for w in weights]))


def out_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a transformed linear computes with, read back through its forward (the bias
    switched off, so that each output is one product)."""
    eye = torch.eye(linear.in_features)
    bias = linear.bias
    try:
        linear.bias = None
        with torch.no_grad():
            return linear(eye).T
    finally:
        linear.bias = bias


def test_fused_siblings_share_the_largest_amax():
    model = build_tiny("qwen2")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.mul_(8.0)  # the group amax comes from k: q and v change
    t = qtransform.transform(model, FUSED)
    tattn, tmlp = t.model.layers[0].self_attn, t.model.layers[0].mlp
    want = fused_reference([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    got = [out_weight(m) for m in (tattn.q_proj, tattn.k_proj, tattn.v_proj)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert not torch.equal(got[0], fake_quantize(attn.q_proj.weight.detach(), "nvfp4"))
    gate_up = fused_reference([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert torch.equal(out_weight(tmlp.gate_proj), gate_up[0])
    assert torch.equal(out_weight(tmlp.up_proj), gate_up[1])
    # not fused: o_proj and down_proj keep their own global scale
    assert torch.equal(out_weight(tattn.o_proj), fake_quantize(attn.o_proj.weight.detach(), "nvfp4"))


def test_compressed_tensors_variant_and_logits():
    model = build_tiny("llama")
    policy = {"version": 1, "quantize": [{**FUSED["quantize"][0], "nvfp4_variant": "compressed-tensors"}]}
    t = qtransform.transform(model, policy)
    attn = model.model.layers[1].self_attn
    want = fused_reference([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                           nvfp4_variant="compressed-tensors")
    assert torch.equal(out_weight(t.model.layers[1].self_attn.v_proj), want[2])


def test_every_member_requantizes_when_one_weight_moves_the_group_amax():
    model = build_tiny("qwen2")
    t = qtransform.transform(model, FUSED)
    attn = t.model.layers[0].self_attn
    x = ids(2, 6)
    with torch.no_grad():
        t(input_ids=x)  # every cache filled
        attn.v_proj.weight.mul_(16.0)  # an in-place write (as an optimizer step): v's amax grows
        t(input_ids=x)
    want = fused_reference([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    h = torch.randn(3, attn.q_proj.in_features)
    with torch.no_grad():  # q's own weight did not change, yet its global scale did
        assert torch.equal(attn.q_proj(h), F.linear(h, want[0], attn.q_proj.bias))
        assert torch.equal(attn.k_proj(h), F.linear(h, want[1], attn.k_proj.bias))


def test_a_members_write_reaches_its_siblings_through_the_models_forward():
    """Inside the model's forward a weight-only site computes with its cached copy without
    calling its quantizer (core/shortcut.py): a write to v must still re-quantize q and k there,
    between forwards and at a rollout block's entry. Reference: the same weights transformed
    afresh, whose caches never saw the old ones."""
    model = build_tiny("qwen2")
    written = copy.deepcopy(model)  # the original with the same writes
    t = qtransform.transform(model, FUSED)
    x = ids(2, 6)
    with torch.no_grad():
        t(input_ids=x)  # every cache filled
        for m in (t, written):
            m.model.layers[0].self_attn.v_proj.weight.mul_(16.0)
        got = t(input_ids=x).logits
        assert torch.equal(got, qtransform.transform(written, FUSED)(input_ids=x).logits)
        with qtransform.rollout():
            t(input_ids=x)
        for m in (t, written):
            m.model.layers[1].self_attn.q_proj.weight.mul_(4.0)
        with qtransform.rollout():  # a block's entry checks every byte
            got = t(input_ids=x).logits
        assert torch.equal(got, qtransform.transform(written, FUSED)(input_ids=x).logits)


def test_training_step_keeps_the_group_consistent():
    model = build_tiny("qwen2")
    t = qtransform.transform(model, FUSED).train()
    opt = torch.optim.SGD(t.parameters(), lr=1.0)
    x = ids(2, 6)
    for _ in range(2):
        opt.zero_grad()
        t(input_ids=x, labels=x).loss.backward()
        opt.step()
    attn = t.model.layers[1].self_attn
    want = fused_reference([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    t.eval()
    for m, w in zip((attn.q_proj, attn.k_proj, attn.v_proj), want, strict=True):
        assert torch.equal(out_weight(m), w)


def test_explicit_groups():
    model = build_tiny("qwen2")
    policy = {"version": 1, "quantize": [{
        "targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
        "share_scale": [["model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]]}]}
    t = qtransform.transform(model, policy)
    layer = model.model.layers[0]
    # o_proj [64, 64] and down_proj [64, 128] differ in width: the reference scales them alike
    amax = torch.maximum(layer.self_attn.o_proj.weight.abs().amax(), layer.mlp.down_proj.weight.abs().amax())
    pad = torch.zeros(1, layer.self_attn.o_proj.in_features)
    pad[0, 0] = amax  # a row holding the group amax: the tensor scale of the stacked matrix
    want = fake_quantize(torch.cat([layer.self_attn.o_proj.weight.detach(), pad]), "nvfp4")[:-1]
    assert torch.equal(out_weight(t.model.layers[0].self_attn.o_proj), want)
    # q/k/v are not grouped here
    q = layer.self_attn.q_proj.weight.detach()
    assert torch.equal(out_weight(t.model.layers[0].self_attn.q_proj), fake_quantize(q, "nvfp4"))


def test_plan_shows_the_groups():
    plan = qtransform.plan(build_tiny("qwen2"), FUSED)
    rows = {r.site: r.detail for r in plan.rows if r.point == "weight"}
    assert rows["model.layers.0.self_attn.q_proj"].endswith(
        "global scale shared with model.layers.0.self_attn.k_proj, model.layers.0.self_attn.v_proj")
    assert "shared" not in rows["model.layers.0.self_attn.o_proj"]
    assert any("4 scale group(s)" in n for n in plan.notes)  # 2 layers x (qkv, gate/up)


def test_a_group_quantized_in_part_names_its_members():
    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head", "re:.*layers\\.1\\.self_attn\\.k_proj"],
         "format": "nvfp4", "share_scale": "fused"}]}
    with pytest.raises(UserError, match=r"model\.layers\.1\.self_attn\.k_proj is not quantized"):
        qtransform.plan(build_tiny("qwen2"), policy)
    mixed = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "share_scale": "fused"},
        {"targets": ["re:.*layers\\.0\\.mlp\\.up_proj"], "format": "mxfp4"}]}
    with pytest.raises(UserError, match=r"up_proj is quantized by quantize\[1\] \(mxfp4\)"):
        qtransform.plan(build_tiny("qwen2"), mixed)


def test_explicit_pattern_that_matches_nothing():
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "nvfp4",
                                          "share_scale": [["model.layers.0.attn.q"]]}]}
    with pytest.raises(UserError, match="share_scale pattern 'model.layers.0.attn.q' matches no site"):
        qtransform.plan(build_tiny("qwen2"), policy)


def test_share_scale_policy_errors():
    for rule, text in [
        ({"format": "mxfp4", "share_scale": "fused"}, "mxfp4 has no tensor-level scale to share"),
        ({"format": "nvfp4", "tensors": ["input"], "share_scale": "fused"}, 'tensors must include "weight"'),
        ({"format": "nvfp4", "nvfp4_variant": "one_level", "share_scale": "fused"}, "no tensor-level scale"),
        ({"format": "nvfp4", "lora": "merged", "share_scale": "fused"}, "merged LoRA"),
    ]:
        with pytest.raises(PolicyError, match=text):
            load_policy({"version": 1, "quantize": [rule]})


def test_fused_experts_keep_one_scale_per_expert():
    """A fused gate_up_proj holds each expert's gate and up: one tensor scale per expert over
    both already is llm-compressor's fused gate/up of that expert."""
    model = build_tiny("qwen3_moe")
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head", "re:.*mlp\\.gate"],
                                          "format": "nvfp4", "share_scale": "fused"}]}
    plan = qtransform.plan(model, policy)
    experts = [r for r in plan.rows if r.site.endswith("experts.gate_up_proj")]
    assert experts and all("shared" not in r.detail for r in experts)
    t = qtransform.transform(model, policy)
    x = ids(2, 5)
    with torch.no_grad():
        assert torch.isfinite(t(input_ids=x).logits).all()


def test_peft_base_layers_are_grouped_by_their_user_names():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_tiny("qwen2"), peft.LoraConfig(r=4, target_modules="all-linear"))
    t = qtransform.transform(model, FUSED)
    base = model.base_model.model.model.layers[0].self_attn
    want = fused_reference([base.q_proj.base_layer.weight, base.k_proj.base_layer.weight,
                            base.v_proj.base_layer.weight])
    q = t.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert torch.equal(out_weight(q), want[0])


def test_a_rotated_group_shares_the_scale_of_its_rotated_weights():
    """With a rotate rule the members quantize W·R, so the fused matrix is the rotated weights
    stacked (llm-compressor fuses QuIP's transforms before it computes the global scale)."""
    from qtransform.core.rotation import apply_rotation, rotation_operand

    model = build_tiny("qwen2")
    policy = {**FUSED, "rotate": [{"targets": ["Linear"], "ignore": ["lm_head"], "block_size": 16}]}
    t = qtransform.transform(copy.deepcopy(model), policy)
    attn = t.model.layers[0].self_attn
    ops = rotation_operand("hadamard", 16)
    rotated = [apply_rotation(getattr(attn, n).weight.detach(), ops) for n in ("q_proj", "k_proj", "v_proj")]
    expected = fused_reference(rotated)
    with torch.no_grad():
        for name, ref in zip(("q_proj", "k_proj", "v_proj"), expected, strict=True):
            site = getattr(attn, name)
            got = site.weight_fake_quant(site.weight_rotate(site.weight))
            assert torch.equal(got, ref), name
