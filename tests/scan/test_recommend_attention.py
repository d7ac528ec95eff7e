"""A recommendation from a scan that measured attention tensors keeps each site out of the rules
of its own kind: the policy it writes transforms the model (an ignore entry naming an attention
module in a Linear rule, or a Linear in a KV rule, would match nothing and be refused)."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.scan.recommend import attention_sites, ignoring

POLICY = {"version": 1, "quantize": [
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight", "input"]},
    {"format": "fp8_e5m2", "tensors": ["key", "value"], "granularity": "token"}]}


def test_kept_sites_go_to_the_rules_of_their_kind():
    rules = [dict(r) for r in POLICY["quantize"]]
    out = ignoring(rules, ["model.layers.0.self_attn", "model.layers.0.mlp.down_proj"],
                   attention={"model.layers.0.self_attn"})
    assert out[0]["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj"]
    assert out[1]["ignore"] == ["model.layers.0.self_attn"]


def test_a_kv_scan_keeps_its_sites_in_a_policy_the_model_takes():
    model = build_tiny("qwen2", hidden=128)
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    report = qtransform.scan_activations(model, POLICY, ids)
    assert attention_sites(report) == {f"model.layers.{i}.self_attn" for i in range(2)}
    kept = [r.site for r in report.rows if r.layer == 0]  # a layer kept whole, as the guide does
    assert "model.layers.0.self_attn" in kept and "model.layers.0.mlp.down_proj" in kept
    rules = ignoring([dict(r) for r in POLICY["quantize"]], kept, attention_sites(report))
    plan = qtransform.plan(model, {"version": 1, "quantize": rules})
    quantized = {r.site for r in plan.rows if r.pass_name == "fake_quant"}
    assert not set(kept) & quantized
    assert {"model.layers.1.self_attn", "model.layers.1.mlp.down_proj"} <= quantized
    every_rule = [{**r, "ignore": [*r.get("ignore", []), *kept]} for r in POLICY["quantize"]]
    with pytest.raises(UserError, match="matches no"):  # what ignoring them everywhere would do
        qtransform.plan(model, {"version": 1, "quantize": every_rule})
