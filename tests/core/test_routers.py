"""MoE routers stay in high precision unless a rule names them.

Every deployment stack keeps routers unquantized (llm-compressor's `re:.*mlp.gate$`, ModelOpt's
disabled router quantizers, vLLM's unquantized gate), so class selectors such as `Linear` pass
them by; `Router`, the router's own class or its name reach them, and plans list what was
skipped. Real transformers classes built from small configs, plus one block in the layout of
transformers 4 (an `nn.Linear` gate beside an `nn.ModuleList` of experts), which 5.x no longer
ships but remote code and older checkpoints' classes still use.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qtransform
from qtransform.core.sites import discover_sites, router_names
from qtransform.models import MOE, build_tiny
from qtransform.schemas.selectors import Selector, compile_entry

ROUTERS = {"mixtral": ("mlp.gate",), "qwen3_moe": ("mlp.gate",),
           "qwen2_moe": ("mlp.gate", "mlp.shared_expert_gate")}
CLASSES = {"mixtral": "MixtralTopKRouter", "qwen3_moe": "Qwen3MoeTopKRouter", "qwen2_moe": "Qwen2MoeTopKRouter"}


def _rule(targets: list[str], **extra) -> dict:
    return {"targets": targets, "format": "mxfp4", **extra}


def _policy(*rules: dict, **sections) -> dict:
    return {"version": 1, "quantize": list(rules), **sections}


def _acted(model: nn.Module, policy: dict) -> set[str]:
    return {r.site for r in qtransform.plan(model, policy).rows}


def _routers(arch: str, layers: int = 2) -> set[str]:
    return {f"model.layers.{i}.{r}" for i in range(layers) for r in ROUTERS[arch]}


class Expert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, 2 * hidden, bias=False), nn.Linear(hidden, 2 * hidden, bias=False)
        self.w2 = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class SparseMoeBlock(nn.Module):
    """transformers 4's MixtralSparseMoeBlock layout: `gate` is an nn.Linear over the experts."""

    def __init__(self, hidden: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                mask = (chosen[..., k] == e).unsqueeze(-1)
                out = out + mask * weights[..., k : k + 1] * expert(x)
        return out


class OldMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"block_sparse_moe": SparseMoeBlock()}) for _ in range(2))
        self.gate_proj = nn.Linear(16, 16)  # a `gate` name outside an MoE block is no router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer["block_sparse_moe"](x)
        return self.gate_proj(x)


def _dbrx() -> nn.Module:
    config = tf.DbrxConfig(d_model=32, n_heads=2, n_layers=1, max_seq_len=64, vocab_size=128,
                           ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
                           attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0})
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


# -- which modules are routers -----------------------------------------------------------------
@pytest.mark.parametrize("arch", MOE)
def test_the_routers_of_each_moe_family(arch):
    """transformers 5.23 builds every router of these families as a `*TopKRouter` module with its
    own weight; Qwen2-MoE's `shared_expert_gate` (an nn.Linear whose sigmoid weighs the shared
    expert) is a router too, as ModelOpt and vLLM treat it."""
    model = build_tiny(arch)
    sites = discover_sites(model)
    assert router_names(model) == _routers(arch)
    assert {n for n, s in sites.items() if s.role == "router"} == _routers(arch)
    for i in range(2):
        assert sites[f"model.layers.{i}.mlp.gate"].cls_name == CLASSES[arch]
    assert not router_names(build_tiny("qwen2"))  # gate_proj is an MLP projection, not a router


def test_linear_gates_beside_experts_and_linears_inside_a_router_module():
    """The rule ModelOpt's export applies: the `gate` / `router` / `shared_expert_gate` child of a
    module holding `experts`; an nn.Linear gate (transformers 4 layout) is one, and so is the
    Linear inside a router module without its own weight (DBRX's `router.layer`)."""
    old = OldMoe()
    assert router_names(old) == {f"layers.{i}.block_sparse_moe.gate" for i in range(2)}
    sites = discover_sites(old)
    assert sites["layers.0.block_sparse_moe.gate"].cls_name == "Linear"
    assert sites["gate_proj"].role == "gate"
    assert router_names(_dbrx()) == {"transformer.blocks.0.ffn.router.layer"}


# -- what reaches them -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", MOE)
def test_class_selectors_pass_routers_by_and_names_reach_them(arch):
    model = build_tiny(arch)
    routers = _routers(arch)
    everything = {s.name for s in discover_sites(model).values() if s.kind in ("linear", "experts")}
    assert _acted(model, _policy(_rule(["Linear"]))) == everything - routers
    assert _acted(model, _policy(_rule(["Linear", "Router"]))) == everything
    assert _acted(model, _policy(_rule(["Router"]))) == routers
    assert _acted(model, _policy(_rule([CLASSES[arch]]))) == _routers("mixtral")  # the TopK routers
    assert _acted(model, _policy(_rule(["mlp.gate"]))) == _routers("mixtral")
    assert _acted(model, _policy(_rule(["re:.*\\.mlp\\.gate"]))) == _routers("mixtral")
    # a later rule that names the routers overrides the class rule that passed them by
    named = _policy(_rule(["Linear"]), _rule(["Router"], format="nvfp4"))
    rows = {r.site: r.rule for r in qtransform.plan(model, named).rows}
    assert {s for s, rule in rows.items() if rule == "quantize[1]"} == routers


def test_linear_never_reaches_an_nn_linear_router():
    """An nn.Linear gate's class is Linear, yet the class selector passes it by like any router."""
    old = OldMoe()
    acted = _acted(old, _policy(_rule(["Linear"])))
    assert not any(s.endswith("gate") for s in acted) and "gate_proj" in acted
    assert {s for s in _acted(old, _policy(_rule(["Router"])))} == router_names(old)
    assert _acted(old, _policy(_rule(["block_sparse_moe.gate"]))) == router_names(old)
    dbrx = _dbrx()
    assert "transformer.blocks.0.ffn.router.layer" not in _acted(dbrx, _policy(_rule(["Linear"])))
    assert _acted(dbrx, _policy(_rule(["Router"]))) == {"transformer.blocks.0.ffn.router.layer"}


def test_mlp_gate_never_matches_gate_up_proj():
    """volcengine/verl#7519: substring matching let `mlp.gate` swallow `mlp.gate_up_proj`. Here a glob
    matches whole dotted parts and a regex the whole name: Phi-3's nn.Linear `mlp.gate_up_proj`
    and Qwen3-MoE's fused `mlp.experts.gate_up_proj` are never taken."""
    config = tf.Phi3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                           pad_token_id=0, eos_token_id=1, bos_token_id=1)
    phi3 = tf.AutoModelForCausalLM.from_config(config)
    assert "model.layers.0.mlp.gate_up_proj" in discover_sites(phi3)
    for entry in ("mlp.gate", "re:.*mlp\\.gate", "re:.*mlp.gate"):
        with pytest.raises(qtransform.UserError, match="matches no"):
            qtransform.plan(phi3, _policy(_rule([entry])))
        assert _acted(build_tiny("qwen3_moe"), _policy(_rule([entry]))) == _routers("qwen3_moe")
    ignored = _acted(build_tiny("qwen3_moe"), _policy(_rule(["Linear", "Router"], ignore=["mlp.gate"])))
    assert "model.layers.0.mlp.experts.gate_up_proj" in ignored and not ignored & _routers("qwen3_moe")


@settings(max_examples=60, deadline=None)
@given(st.from_regex(r"[A-Z][A-Za-z0-9_]{0,20}", fullmatch=True))
def test_no_class_selector_but_router_or_the_own_class_matches_a_router(text):
    site = discover_sites(build_tiny("mixtral", num_layers=1, hidden=32))["model.layers.0.mlp.gate"]
    linear_gate = discover_sites(OldMoe())["layers.0.block_sparse_moe.gate"]
    assert compile_entry(text).matches(site) is (text in ("Router", "MixtralTopKRouter"))
    assert compile_entry(text).matches(linear_gate) is (text == "Router")


# -- plans and other sections say so ----------------------------------------------------------
def test_plan_lists_the_skipped_routers_with_why():
    model = build_tiny("qwen2_moe")
    policy = _policy(_rule(["Linear"], ignore=["lm_head"]),
                     instrument={"points": ["output"]}, hw_error={"error_scale": 0.05})
    plan = qtransform.plan(model, policy)
    assert plan.skipped == {r: ["quantize[0]", "hw_error", "instrument"] for r in _routers("qwen2_moe")}
    lines = plan.to_text().splitlines()
    gate = next(line for line in lines if line.startswith("model.layers.0.mlp.gate "))
    assert gate.endswith("skipped: MoE router [quantize[0], hw_error, instrument]")
    assert lines[-1].startswith("4 MoE routers skipped: they stay in high precision")
    assert 'add "Router" or their names' in lines[-1]
    data = plan.to_dict()
    by_name = {s["name"]: s for s in data["sites"]}
    assert by_name["model.layers.1.mlp.shared_expert_gate"]["skipped_by"] == ["quantize[0]", "hw_error", "instrument"]
    assert "skipped_by" not in by_name["model.layers.0.mlp.experts.gate_up_proj"]
    assert data["notes"][-1] == lines[-1]
    # the transform's own plan says the same; routers named or ignored are not "skipped"
    program = qtransform.transform_program(model, policy)
    assert program.plan().to_text() == plan.to_text()
    for quiet in (_policy(_rule(["Linear", "Router"])), _policy(_rule(["Linear"], ignore=["Router"])),
                  _policy(_rule(["re:.*proj"]))):
        assert not qtransform.plan(model, quiet).skipped
        assert "skipped" not in qtransform.plan(model, quiet).to_text()


def test_instrument_and_noise_reach_routers_only_when_named():
    model = build_tiny("mixtral", num_layers=1)
    router = "model.layers.0.mlp.gate"
    named = {"version": 1, "instrument": {"targets": ["Router"], "points": ["output"]},
             "hw_error": {"targets": ["mlp.gate"], "error_scale": 0.05}}
    rows = {(r.site, r.pass_name) for r in qtransform.plan(model, named).rows}
    assert rows == {(router, "instrument"), (router, "hw_error")}
    default = {"version": 1, "instrument": {"points": ["output"]}, "hw_error": {"error_scale": 0.05}}
    assert router not in {r.site for r in qtransform.plan(model, default).rows}
    assert Selector.compile(["Linear"]).passed_routers(discover_sites(model).values()) == [router]


def test_cli_plan_prints_the_skipped_routers(tmp_path):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps(_policy(_rule(["Linear"], ignore=["lm_head"]))))
    proc = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", "builtin:mixtral", str(policy)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipped: MoE router [quantize[0]]" in proc.stdout
    assert "2 MoE routers skipped: they stay in high precision" in proc.stdout
