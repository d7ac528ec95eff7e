"""Mixture-of-experts models: fused experts are sites everywhere.

Tiny Mixtral, Qwen2-MoE and Qwen3-MoE built from configs (4 experts, 2 per token, seeded
weights). References are computed independently: a deep copy whose weights are replaced by the
format functions applied matrix by matrix, and a per-expert loop written here.
"""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import qtransform
from qtransform.core.sites import discover_sites
from qtransform.formats import fake_quantize
from qtransform.models import BUILTIN, MOE, build_tiny
from qtransform.scan.activations import scan_activations
from qtransform.scan.weights import scan_weights

IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _policy(fmt: str, tensors: tuple[str, ...] = ("weight",), **rule) -> dict:
    return {"version": 1, "quantize": [{"targets": ["Linear"], "format": fmt, "tensors": list(tensors), **rule}]}


# the modules whose output picks or weighs experts, named here by hand for each tiny model
ROUTERS = {"mixtral": ("mlp.gate",), "qwen3_moe": ("mlp.gate",),
           "qwen2_moe": ("mlp.gate", "mlp.shared_expert_gate")}


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate", ".mlp.shared_expert_gate"))


def _quantized_copy(model: torch.nn.Module, fmt: str, *, routers: bool = False) -> torch.nn.Module:
    """Every Linear-like weight replaced by its fake-quantized value, each expert's matrix alone;
    the routers' weights too only when `routers`."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if _is_router(name) and not routers:
                continue
            for pname, p in module.named_parameters(recurse=False):
                if p.ndim == 3:
                    p.copy_(torch.stack([fake_quantize(p[e], fmt) for e in range(p.shape[0])]))
                elif pname == "weight" and p.ndim == 2 and "embed" not in name:
                    p.copy_(fake_quantize(p, fmt))
    return ref


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_linear_rule_quantizes_experts_and_keeps_routers_in_high_precision(arch, fmt):
    model = build_tiny(arch, hidden=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = _quantized_copy(model, fmt)(input_ids=IDS).logits
    out = qtransform.transform(model, _policy(fmt))
    with torch.no_grad():
        got = out(input_ids=IDS).logits
    assert torch.equal(got, want)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # original untouched
    sites = {i.site for i in qtransform.insertion_log(out)}
    assert "model.layers.1.mlp.experts.down_proj" in sites
    routers = {f"model.layers.{i}.{r}" for i in range(2) for r in ROUTERS[arch]}
    assert {s.name for s in discover_sites(model).values() if s.role == "router"} == routers
    assert not routers & sites
    # naming them (the Router selector) quantizes them as before: the old behaviour, one entry away
    both = qtransform.transform(model, _policy(fmt, targets=["Linear", "Router"]))
    with torch.no_grad():
        got = both(input_ids=IDS).logits
    assert torch.equal(got, _quantized_copy(model, fmt, routers=True)(input_ids=IDS).logits)
    assert routers <= {i.site for i in qtransform.insertion_log(both)}


def test_nvfp4_tensor_scale_is_per_expert():
    model = build_tiny("mixtral", hidden=32)
    w = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    w[0] *= 1000  # one expert far larger: a shared tensor scale would crush the others
    fq = qtransform.transform(model, _policy("nvfp4"))
    module = fq.model.layers[0].mlp.experts.gate_up_proj__weight_fake_quant
    got = module(w)
    for e in range(w.shape[0]):
        assert torch.equal(got[e], fake_quantize(w[e], "nvfp4"))
    assert not torch.equal(got[1], fake_quantize(w, "nvfp4")[1])


def test_input_points_quantize_each_experts_token_slice():
    """W4A4 on the experts against a per-expert loop written here in float64."""
    model = build_tiny("qwen3_moe", hidden=32)
    experts = model.model.layers[0].mlp.experts
    params = {n: p.detach().clone() for n, p in experts.named_parameters()}
    out = qtransform.transform(model, _policy("mxfp4", ("weight", "input"), targets=["Qwen3MoeExperts"]))
    tx = out.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 32, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=g)
    got = tx(hidden, index, weights)
    want = torch.zeros(11, 32, dtype=torch.float64)
    for t in range(11):
        for j in range(2):
            e = int(index[t, j])
            x = fake_quantize(hidden[t:t + 1], "mxfp4")
            y = F.linear(x.double(), fake_quantize(params["gate_up_proj"][e], "mxfp4").double())
            gate, up = y.chunk(2, dim=-1)
            h = fake_quantize((F.silu(gate) * up).float(), "mxfp4").double()
            want[t] += weights[t, j].double() * F.linear(h, fake_quantize(params["down_proj"][e], "mxfp4").double())[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_selectors_layers_and_ignore_on_experts():
    model = build_tiny("mixtral", hidden=32)
    policy = _policy("mxfp4", layers="1", ignore=["experts.down_proj", "re:.*mlp\\.gate"])
    plan = qtransform.plan(model, policy)
    acted = {r.site for r in plan.rows}
    assert acted >= {"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.self_attn.q_proj"}
    assert not any(".layers.0." in s or s.endswith("down_proj") or s.endswith("mlp.gate") for s in acted)
    by_class = qtransform.plan(model, _policy("mxfp4", targets=["MixtralExperts"]))
    assert {r.site for r in by_class.rows} == {f"model.layers.{i}.mlp.experts.{p}"
                                                  for i in range(2) for p in ("gate_up_proj", "down_proj")}
    site = discover_sites(model)["model.layers.0.mlp.experts.gate_up_proj"]
    assert (site.kind, site.role, site.expert_axis, site.reduction_axis) == ("experts", "experts.gate_up", 0, -1)


@pytest.mark.parametrize("arch", BUILTIN)
def test_one_truth_plan_transform_and_scans_list_the_same_sites(arch):
    model = build_tiny(arch, hidden=32, num_layers=1)
    policy = _policy("mxfp4")
    planned = list(dict.fromkeys(r.site for r in qtransform.plan(model, policy).rows))
    transformed = list(dict.fromkeys(i.site for i in qtransform.insertion_log(qtransform.transform(model, policy))))
    weights = [r.site for r in scan_weights(model, policy=policy).rows]
    compared = [r.site for r in qtransform.compare_formats(model, ["mxfp4"], policy=policy).reports["mxfp4"].rows]
    calib = torch.randint(0, 200, (2, 8))
    acts = list(dict.fromkeys(r.site for r in scan_activations(model, policy, calib).rows if r.point == "weight"))
    assert planned == transformed == weights == compared == acts
    if arch in MOE:
        assert sum(".experts." in s for s in planned) == 2


def test_activation_scan_counts_each_experts_tokens():
    """Only the experts are quantized, so layer 0 routes as the full-precision model does: the
    token counts must equal the routing a hook on the original router sees."""
    model = build_tiny("mixtral", hidden=32)
    calib = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    routed = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: routed.append(out[2]))
    with torch.no_grad():
        model(input_ids=calib)
    hook.remove()
    want = torch.bincount(routed[0].reshape(-1), minlength=4).tolist()
    report = scan_activations(model, _policy("mxfp4", ("weight", "input"), targets=["re:.*experts.*"]), calib)
    row = next(r for r in report.rows if r.site == "model.layers.0.mlp.experts.gate_up_proj" and r.point == "input")
    assert [e["tokens"] for e in row.experts] == want


def test_an_expert_without_tokens_is_reported_as_unmeasured():
    from qtransform.passes.instrument import tapping

    policy = {**_policy("mxfp4", ("weight", "input"), targets=["re:.*experts.*"]),
              "instrument": {"targets": ["re:.*experts.*"], "points": ["input", "output"], "shadow": True}}
    out = qtransform.transform(build_tiny("mixtral", hidden=32), policy)
    experts = out.model.layers[0].mlp.experts
    index = torch.tensor([[0, 1], [1, 2], [2, 0]])  # expert 3 never chosen
    with tapping(out) as found, torch.no_grad():
        experts(torch.randn(3, 32), index, torch.full((3, 2), 0.5))
    tap = next(t for t in found if t.site.endswith("0.mlp.experts.down_proj") and t.point == "output")
    per_expert = tap.experts()
    assert [e["tokens"] for e in per_expert] == [2, 2, 2, 0]
    assert per_expert[3]["metrics"] is None and all(e["metrics"]["sqnr_db"] > 0 for e in per_expert[:3])


@pytest.mark.parametrize("arch", MOE)
def test_onnx_export_matches_pytorch_with_named_expert_nodes(arch, tmp_path):
    import onnx

    out = qtransform.transform(build_tiny(arch, hidden=32, num_layers=1), _policy("nvfp4", ("weight", "input")))
    path = qtransform.export_onnx(out, tmp_path / "m.onnx", {"input_ids": IDS})
    with torch.no_grad():
        want = out(input_ids=IDS).logits.numpy()
    got = ort.InferenceSession(str(path)).run(None, {"input_ids": IDS.numpy()})[0]
    assert np.abs(got - want).max() < 1e-4
    names = {n.name for n in onnx.load(str(path)).graph.node}
    assert "model.layers.0.mlp.experts.down_proj/input_fake_quant" in names
    assert {f"model.layers.0.mlp.experts.down_proj/weight_fake_quant.expert{e}" for e in range(4)} <= names


def test_graph_mode_quantizes_expert_weights():
    model = build_tiny("mixtral", hidden=32)
    want = _quantized_copy(model, "mxfp4")(input_ids=IDS).logits
    gm = qtransform.transform(model, _policy("mxfp4"), example_inputs={"input_ids": IDS}, mode="graph")
    with torch.no_grad():
        got = gm(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "model.layers.0.mlp.experts.gate_up_proj" in {i.site for i in qtransform.insertion_log(gm)}


# -- fault scans (gain, kurtosis, instability) on experts sites -------------------------------
def _module_io(model: torch.nn.Module, path: str, ids: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """The positional arguments and the output of one module call in a forward of `model`."""
    seen: list = []
    hook = model.get_submodule(path).register_forward_hook(lambda m, a, out: seen.append((a, out)))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    (args, out), = seen
    return args, out


def _pearson_kurtosis(y: torch.Tensor) -> float:
    c = y.double() - y.double().mean()
    return float(c.pow(4).mean() / c.pow(2).mean() ** 2)


@pytest.mark.parametrize("arch", MOE)
def test_fault_scans_measure_experts_at_their_module(arch):
    """Gain and kurtosis of an experts site against a float64 computation written here: the
    experts module on the full-precision model's routing, its weights fake-quantized per expert."""

    from qtransform.passes.instrument import tapping
    from qtransform.scan.faults import gain_scan, instability_scan, kurtosis_scan, stochastic_policy
    from qtransform.scan.setup import resolve_policy

    model = build_tiny(arch, hidden=32, num_layers=1)
    ids = IDS[:1]
    path = "model.layers.0.mlp.experts"
    sites = [f"{path}.gate_up_proj", f"{path}.down_proj"]
    (x, index, weights), fp_out = _module_io(model, path, ids)
    fp_experts = model.get_submodule(path)
    q_experts = copy.deepcopy(fp_experts)
    with torch.no_grad():
        for p in q_experts.parameters():
            p.copy_(torch.stack([fake_quantize(p[e], "mxfp4") for e in range(p.shape[0])]))
    # the scan's stream for this module (seed 0, first call): docs/noise.md's blake2b key, written out
    key = hashlib.blake2b(f"0/{path}/gain_probe/0/0".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    xp = x + 1e-3 * x.pow(2).mean().sqrt() * torch.randn(x.shape, generator=gen)
    d = xp.double() - x.double()  # the perturbation as float32 represents it
    with torch.no_grad():
        resp = {name: e(xp, index, weights).double() - e(x, index, weights).double()
                for name, e in (("fp", fp_experts), ("q", q_experts))}
    gain = {k: float(v.norm() / d.norm()) for k, v in resp.items()}

    rows = {r.site: r.metrics for r in gain_scan(model, "mxfp4", ids).rows}
    for site in sites:
        assert rows[site]["gain_fp"] == pytest.approx(gain["fp"], rel=1e-9)
        assert rows[site]["gain_q"] == pytest.approx(gain["q"], rel=1e-9)
    assert rows[sites[0]]["gain_ratio"] != 1.0

    kurt = {r.site: r.metrics for r in kurtosis_scan(model, "mxfp4", ids).rows}
    _, q_out = _module_io(qtransform.transform(model, resolve_policy(model, "mxfp4")), path, ids)
    for site in sites:
        assert kurt[site]["kurtosis_fp"] == pytest.approx(_pearson_kurtosis(fp_out), rel=1e-9)
        assert kurt[site]["kurtosis_q"] == pytest.approx(_pearson_kurtosis(q_out), rel=1e-9)

    unstable = {r.site: r.metrics for r in instability_scan(model, "mxfp4", ids, runs=3, seed=5).rows}
    # the same stochastic policy transformed again draws the same numbers: recompute directly
    again = qtransform.transform(model, stochastic_policy(resolve_policy(model, "mxfp4"), 5))
    with tapping(again, False):
        runs = torch.stack([_module_io(again, path, ids)[1].double() for _ in range(3)])
    for site in sites:
        assert unstable[site]["variance"] == pytest.approx(float(runs.var(dim=0).mean()), rel=1e-9)
    assert not any(_is_router(s) for s in (*unstable, *rows))  # a format scan passes routers by
    named = _policy("mxfp4", targets=["Router"])  # ... and measures them when named
    unstable = {r.site: r.metrics for r in instability_scan(model, named, ids, runs=3, seed=5).rows}
    rows = {r.site: r.metrics for r in gain_scan(model, named, ids).rows}
    router = "model.layers.0.mlp.gate"  # a TopKRouter's output is a tuple: measured at its logits
    assert unstable[router]["variance"] > 0 and math.isfinite(rows[router]["gain_ratio"])


def test_fault_scan_hooks_are_removed_when_a_site_is_missing():
    from qtransform.scan.faults import GainProbe

    model = build_tiny("mixtral", hidden=32, num_layers=1)
    with pytest.raises(AttributeError):
        GainProbe(model, model, ["model.layers.0.self_attn.q_proj", "model.layers.0.no_such"], 1e-3, 0)
    assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("arch", MOE)
def test_checkpoint_scan_lists_the_models_sites_and_values(arch, tmp_path):
    """A checkpoint written by save_pretrained (per-expert 2-D tensors; Mixtral's
    `block_sparse_moe.experts.<e>.w1`) and a raw state dict (fused 3-D tensors) both scan to the
    in-memory model's sites, roles and exact accumulator sums, expert by expert."""
    from safetensors.torch import save_file

    model = build_tiny(arch, hidden=32, num_layers=1)
    policy = _policy("nvfp4", targets=["Linear", "Router"])
    want = {r.site: r for r in scan_weights(model, policy=policy).rows}
    model.save_pretrained(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "fused.safetensors")
    for source in (tmp_path / "hf", tmp_path / "fused.safetensors"):
        got = {r.site: r for r in scan_weights(source, policy=policy).rows}
        assert set(got) == set(want)
        for name, row in want.items():
            assert (got[name].role, got[name].kind, got[name].shape) == (row.role, row.kind, row.shape)
            assert got[name].state == row.state and got[name].experts == row.experts
    assert sum(r.kind == "experts" for r in want.values()) == 2
    assert {n for n, r in want.items() if r.role == "router"} == {f"model.layers.0.{r}" for r in ROUTERS[arch]}


def test_reports_render_each_expert_and_merge_them_per_layer():
    """One calibration token reaches 2 of 4 experts per layer: the other two say "no tokens" in
    CSV and Markdown; the per-layer merge of an expert's weights is checked in float64 here."""
    import csv
    import io

    from qtransform.scan import render
    from qtransform.scan.report import ScanReport

    model = build_tiny("mixtral", hidden=32, num_layers=1)
    policy = _policy("mxfp4", ("weight", "input"), targets=["re:.*experts.*"])
    report = ScanReport.from_dict(scan_activations(model, policy, torch.tensor([[7]])).to_dict())
    summary = report.expert_summary()
    inputs = [e for e in summary if e["point"] == "input"]
    assert sorted(e["tokens"] for e in inputs) == [0, 0, 1, 1]
    assert all((e["metrics"] is None) == (e["tokens"] == 0) for e in inputs)
    experts = model.model.layers[0].mlp.experts
    for e in range(4):
        w = [getattr(experts, p)[e].detach() for p in ("gate_up_proj", "down_proj")]
        signal = sum(float(x.double().pow(2).sum()) for x in w)
        error = sum(float((x.double() - fake_quantize(x, "mxfp4").double()).pow(2).sum()) for x in w)
        got = next(s for s in summary if s["point"] == "weight" and s["expert"] == e)
        assert got["sites"] == 2 and got["metrics"]["sqnr_db"] == pytest.approx(10 * math.log10(signal / error), rel=1e-12)
    lines = list(csv.DictReader(io.StringIO(render.to_csv(report))))
    per_expert = [r for r in lines if r["expert"] != "" and r["point"] == "input"]
    assert len(per_expert) == 8 and sum(r["problems"] == "no tokens" for r in per_expert) == 4
    assert all((r["sqnr_db"] == "") == (r["tokens"] == "0") for r in per_expert)
    md = render.to_markdown(report)
    assert "## Experts" in md and "### Experts by site" in md and md.count("| no tokens |") >= 4
