"""Capture: the site table, the whole-model graph and its dataflow, export failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import qtransform
from qtransform.core.capture import CaptureError
from qtransform.pipeline import Action, Pass, PassManager
from tests.conftest import ids


def test_site_table_qwen2(tiny):
    model = tiny("qwen2")
    program = qtransform.capture(model)
    s = program.sites
    q = s["model.layers.1.self_attn.q_proj"]
    assert (q.kind, q.layer, q.role, q.cls_name) == ("linear", 1, "q", "Linear")
    assert q.weight_shape == (64, 64) and not q.weight_transposed
    assert s["model.layers.0.mlp.down_proj"].role == "down"
    assert s["model.layers.0.mlp.down_proj"].weight_shape == (64, 128)
    norm = s["model.layers.0.input_layernorm"]
    assert (norm.kind, norm.role, norm.cls_name, norm.layer) == ("norm", "norm", "Qwen2RMSNorm", 0)
    assert s["lm_head"].role == "lm_head" and s["lm_head"].layer is None
    kinds = [x.kind for x in s.values()]
    assert kinds.count("linear") == 2 * 7 + 1 and kinds.count("norm") == 2 * 2 + 1


def test_site_table_gpt2_conv1d_and_bert_roles(tiny):
    gpt = qtransform.capture(tiny("gpt2")).sites
    attn = gpt["transformer.h.1.attn.c_attn"]
    assert (attn.kind, attn.role, attn.layer, attn.weight_transposed) == ("conv1d", "qkv", 1, True)
    assert attn.weight_shape == (64, 192) and attn.reduction_axis == 0
    assert gpt["transformer.h.0.attn.c_proj"].role == "o"
    assert gpt["transformer.h.0.mlp.c_proj"].role == "down"
    assert gpt["transformer.ln_f"].kind == "norm"
    bert = qtransform.capture(tiny("bert")).sites
    assert bert["encoder.layer.1.attention.self.query"].role == "q"
    assert bert["encoder.layer.1.attention.output.dense"].role == "o"
    assert bert["encoder.layer.1.intermediate.dense"].role == "up"
    assert bert["encoder.layer.1.output.dense"].role == "down"
    assert bert["encoder.layer.1.output.LayerNorm"].kind == "norm"


def test_whole_graph_order_and_norm_feeds(tiny):
    model = tiny("qwen2")
    program = qtransform.capture(model, {"input_ids": ids()})
    order = program.whole.order
    layer0 = [n for n in order if n.startswith("model.layers.0.") and program.sites[n].kind == "linear"]
    assert [n.rsplit(".", 1)[1] for n in layer0] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert order.index("model.layers.1.self_attn.q_proj") > order.index("model.layers.0.mlp.down_proj")
    s = program.sites
    assert s["model.layers.0.input_layernorm"].feeds == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.v_proj"]
    assert s["model.layers.0.post_attention_layernorm"].feeds == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert s["model.norm"].feeds == ["lm_head"]
    matmuls = [x for x in s.values() if x.kind == "matmul"]
    assert matmuls and all(m.layer in (0, 1) for m in matmuls)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow cannot be exported
            return self.fc(x)
        return x


def test_export_failure_names_construct_and_module_mode_still_works():
    model = _DataDependent()
    with pytest.raises(CaptureError, match=r"test_capture.py:\d+ \(if x.sum\(\) > 0"):
        qtransform.capture(model, torch.ones(2, 4))
    program = qtransform.capture(model)
    assert list(program.sites) == ["fc"]


class _P(Pass):
    tag = "p"

    def __init__(self, name, requires=(), provides=()):
        self.name, self.requires, self.provides = name, requires, provides

    def select(self, program, policy) -> list[Action]:
        return []

    def build(self, program, action):
        return nn.Identity()


def test_pass_manager_orders_by_dependencies_and_names_problems():
    manager = PassManager([_P("taps", requires=("q",)), _P("quant", provides=("q",))])
    assert [p.name for p in manager.order] == ["quant", "taps"]
    with pytest.raises(ValueError, match="'taps' requires 'noise', which no pass provides"):
        PassManager([_P("taps", requires=("noise",))])
    with pytest.raises(ValueError, match="cycle: (a -> b|b -> a)"):
        PassManager([_P("a", requires=("y",), provides=("x",)), _P("b", requires=("x",), provides=("y",))])
