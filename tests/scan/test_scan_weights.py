"""Weight scans of modules and safetensors checkpoints, format comparison, and the scan CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from qtransform.cli.main import main
from qtransform.core.metrics import BlockExponentHistogram
from qtransform.errors import UserError
from qtransform.formats import block_exponents
from qtransform.scan.render import FILES
from qtransform.scan.report import ScanReport
from qtransform.scan.sources import checkpoint_weights
from qtransform.scan.weights import compare_formats, scan_weights
from qtransform.schemas import load_policy
from tests.helpers import assert_metrics, assert_untouched, metrics_f64, mxfp4_f64, snapshot

HIDDEN = 64


class Conv1D(nn.Module):
    """GPT-2's layout: the weight is stored [in, out]."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.c_attn = Conv1D(HIDDEN, 3 * HIDDEN)
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.mlp.fc2 = nn.Linear(2 * HIDDEN, HIDDEN)


class Tiny(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(50, HIDDEN)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.lm_head = nn.Linear(HIDDEN, 50, bias=False)
        for lin in (m for m in self.modules() if isinstance(m, nn.Linear)):
            nn.init.normal_(lin.weight, std=0.02)


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


def qwen_checkpoint(path: Path, layers: int = 3, seed: int = 0) -> Path:
    """A Qwen2-named safetensors checkpoint with embeddings, norms and biases to skip."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(100, HIDDEN, generator=g),
         "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": torch.randn(100, HIDDEN, generator=g) * 0.02}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (32, HIDDEN)),
                            ("mlp.up_proj", (128, HIDDEN)), ("mlp.down_proj", (HIDDEN, 128))):
            t[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.02 * (1 + i)
        t[p + "self_attn.q_proj.bias"] = torch.zeros(HIDDEN)
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(path))
    return path


def test_module_scan_covers_linear_and_conv1d_with_the_right_axis(tiny):
    before = snapshot(tiny)
    report = scan_weights(tiny, "mxfp4")
    assert_untouched(before, tiny)
    by_site = {r.site: r for r in report.rows}
    assert set(by_site) == {f"h.{i}.{s}" for i in range(3) for s in ("attn.c_attn", "mlp.fc1", "mlp.fc2")} | {"lm_head"}
    conv = by_site["h.1.attn.c_attn"]
    assert (conv.kind, conv.role, conv.layer, conv.shape) == ("conv1d", "qkv", 1, [HIDDEN, 3 * HIDDEN])
    assert by_site["lm_head"].role == "lm_head" and by_site["lm_head"].layer is None
    w = tiny.h[1].attn.c_attn.weight.detach()
    want = metrics_f64(w, *mxfp4_f64(w, axis=0))
    assert_metrics(conv.metrics, want)  # blocked along the reduction axis (0 for [in, out])
    other = metrics_f64(w, *mxfp4_f64(w))["sqnr_db"]
    assert other != pytest.approx(want["sqnr_db"], rel=1e-6)
    exps = conv.block_exponents
    assert exps is not None and exps["blocks"] == w.numel() // 32 and exps["out_of_range"] == 0
    assert report.meta["options"] == {"block_size": 32, "scale_rule": "floor", "rounding": "rne"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("conv", [False, True])
def test_scan_block_exponents_equal_the_formats_block_exponents(dtype, conv, monkeypatch):
    """The histogram the scan takes from its one quantization equals `block_exponents` on the
    reference path, NaN/Inf/zero/subnormal blocks and padded rows included, for every rule."""
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * 0.02  # 70: padded rows
    w[3, 5], w[7, 40], w[10], w[11, :33], w[12], w[13] = math.nan, math.inf, 0.0, 1e-40, 7.9999995, -448.0
    w = w.to(dtype)
    model = nn.Module()
    model.c_proj = Conv1D(70, 40) if conv else nn.Linear(70, 40, bias=False)
    model.c_proj.weight.data = w.T.contiguous() if conv else w  # blocks run along the 70 inputs
    for rule in ("floor", "rceil", "ceil", "even"):
        for fmt in ("mxfp4", "mxfp8_e4m3", "mxint8"):
            row = scan_weights(model, fmt, options={"scale_rule": rule}).rows[0]
            with monkeypatch.context() as m:
                m.setenv("QTRANSFORM_FASTPATH", "0")
                want = BlockExponentHistogram().update(block_exponents(w, fmt, scale_rule=rule))
            assert row.block_exponents == want.result(), (rule, fmt)


def test_checkpoint_scan_matches_the_module_scan(tiny, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(path))
    from_file = scan_weights(path, "nvfp4")
    from_module = scan_weights(tiny, "nvfp4")
    assert [r.site for r in from_file.rows] == [r.site for r in from_module.rows]
    for a, b in zip(from_file.rows, from_module.rows, strict=True):
        assert (a.kind, a.role, a.layer, a.shape) == (b.kind, b.role, b.layer, b.shape)
        assert a.metrics == b.metrics
        assert a.block_exponents is None  # NVFP4 has no shared exponents


def test_checkpoint_folder_skips_embeddings_norms_biases_and_reads_every_shard(tmp_path):
    qwen_checkpoint(tmp_path / "model-00001-of-00002.safetensors", layers=2, seed=0)
    save_file({"model.layers.2.mlp.gate_proj.weight": torch.randn(128, HIDDEN) * 0.02},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {key: path.name for path in sorted(tmp_path.glob("*.safetensors"))
                  for key in safe_open(path, "pt").keys()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refs = checkpoint_weights(tmp_path)
    names = [r.site.name for r in refs]
    assert names == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
        "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.layers.2.mlp.gate_proj", "lm_head",
    ]
    assert refs[0].load().dtype == torch.bfloat16


def test_bad_sources_and_formats_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        scan_weights(tmp_path / "missing", "mxfp4")
    with pytest.raises(UserError, match="no .safetensors files"):
        scan_weights(tmp_path, "mxfp4")
    path = qwen_checkpoint(tmp_path / "m.safetensors", layers=1)
    with pytest.raises(UserError, match="did you mean 'mxfp4'"):
        scan_weights(path, "mxfp5")
    with pytest.raises(UserError, match="scale_rule"):
        scan_weights(path, "nvfp4", options={"scale_rule": "rceil"})


def test_policy_selects_sites_formats_and_thresholds(tmp_path):
    path = qwen_checkpoint(tmp_path / "m.safetensors")
    policy = {
        "version": 1,
        "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "layers": "0-1", "format": "mxfp4"},
                     {"targets": ["down_proj"], "layers": "1", "format": "mxfp8_e4m3", "scale_rule": "rceil"}],
        "instrument": {"thresholds": {"sqnr_db": 15.0}},
    }
    report = scan_weights(path, policy=policy, flagging="absolute")
    formats = {r.site: r.format for r in report.rows}
    assert len(formats) == 8 and "lm_head" not in formats
    assert formats["model.layers.1.mlp.down_proj"] == "mxfp8_e4m3"
    assert formats["model.layers.1.mlp.up_proj"] == "mxfp4"
    assert report.rows[-1].options["scale_rule"] == "rceil"
    assert report.meta["format"] == "mixed" and report.thresholds["sqnr_db"] == 15.0
    # MXFP4 on Gaussian weights: ~19 dB (above the 15 dB asked), ~8 % deadzone, ~2 % saturation,
    # ~11 % rel_rmse, all three over their defaults; MXFP8 (~31 dB) is not flagged
    flagged = {row.site: [w.split()[0] for w in warnings] for row, warnings in report.problems()}
    assert flagged == {site: ["deadzone", "saturation", "rel_rmse"]
                       for site, fmt in formats.items() if fmt == "mxfp4"}
    # the same policy with --format: the policy selects, the format is the one given
    forced = scan_weights(path, "nvfp4", policy=policy)
    assert {r.format for r in forced.rows} == {"nvfp4"} and len(forced.rows) == 8
    # the recorded rules: scale_rule (MX only) dropped, the default targets left implicit
    nvfp4 = {"format": "nvfp4", "block_size": 16, "rounding": "rne", "nvfp4_variant": "default"}
    assert forced.meta["quantize"] == [  # the scanned format's every option spelled out
        {"ignore": ["lm_head"], "layers": "0-1", **nvfp4}, {"targets": ["down_proj"], "layers": "1", **nvfp4}]
    again = load_policy({"version": 1, "quantize": forced.meta["quantize"]})
    assert [(r.format, r.layers) for r in again.quantize] == [("nvfp4", "0-1"), ("nvfp4", "1")]


def test_compare_sums_accumulators_and_explains_mean_relative_error(tiny):
    before = snapshot(tiny)
    result = compare_formats(tiny, ["mxfp8_e4m3", "mxfp6_e2m3"])
    assert_untouched(before, tiny)
    for fmt, report in result.reports.items():
        total = sum(r.state["sum_x2"] for r in report.rows) / sum(r.state["sum_e2"] for r in report.rows)
        assert result.totals[fmt]["sqnr_db"] == pytest.approx(10 * math.log10(total), rel=1e-12)
    # the seed's trap: finer elements win on SQNR but lose on mean relative error via the deadzone
    assert result.winners["sqnr_db"] == "mxfp6_e2m3"
    assert result.winners["mean_rel_error"] == "mxfp8_e4m3"
    assert len(result.notes) == 1 and "deadzone" in result.notes[0] and "SQNR" in result.notes[0]
    data = json.loads(json.dumps(result.to_dict()))
    assert data["winners"]["mse"] == "mxfp6_e2m3" and "| sqnr_db |" in result.markdown()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "qtransform.cli.main", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_cli_scan_writes_reports_and_fails_on_problems(tmp_path, capsys):
    model = qwen_checkpoint(tmp_path / "model.safetensors")
    out = tmp_path / "scan"
    proc = run_cli("scan", str(model), "--format", "mxfp4", "--out", str(out), "--json",
                   "--fail-on-problematic", "--flag-by", "absolute")
    assert proc.returncode == 1, proc.stderr  # MXFP4 weights sit below 20 dB
    data = json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    assert data["schema_version"] == "1" and data["summary"]["sites"] == 13
    assert sorted(p.name for p in out.iterdir()) == sorted([*FILES, "report.html", ".qtransform-output.json"])
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ScanReport.load(out).rows[0].site == "model.layers.0.self_attn.q_proj"

    assert main(["guide", str(out), "--out", str(tmp_path / "policy.json"), "--aqn", "--total-steps", "174"]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err and "AQN's sigma is absolute: `qtransform plan MODEL POLICY`" in err
    policy = load_policy(tmp_path / "policy.json")
    assert policy.noise is not None and policy.noise.schedule.total_steps == 174
    assert set(policy.noise.layer_multipliers.values()) == {1.5, 1.2, 1.0}


def test_cli_messages_and_exit_codes(tmp_path, capsys):
    model = qwen_checkpoint(tmp_path / "model.safetensors", layers=1)
    out = str(tmp_path / "o")
    assert main(["scan", str(model), "--format", "mxfp5", "--out", out]) == 2
    assert "did you mean 'mxfp4'" in capsys.readouterr().err
    assert main(["scan", str(tmp_path / "nope"), "--format", "mxfp4", "--out", out]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["scan", str(model), "--format", "mxfp4", "--threshold", "sqnr=3", "--out", out]) == 2
    assert "did you mean 'sqnr_db'" in capsys.readouterr().err
    loose = ["--threshold", "sqnr_db=5", "--threshold", "saturation=0.5", "--threshold", "relative_error=1",
             "--threshold", "deadzone=0.5"]
    assert main(["scan", str(model), "--format", "mxfp4", "--out", out, "--fail-on-problematic", *loose]) == 0
    text = capsys.readouterr().out
    assert "recommendation: No problematic sites" in text and "lm_head" in text, text
    assert main(["compare", str(model), "--formats", "mxfp4,nvfp4", "--json", "--out", out]) == 2
    assert "is the output of `qtransform scan`" in capsys.readouterr().err  # not replaced
    out = str(tmp_path / "c")
    assert main(["compare", str(model), "--formats", "mxfp4,nvfp4", "--json", "--out", out]) == 0
    assert json.loads(capsys.readouterr().out)["formats"] == ["mxfp4", "nvfp4"]
    assert (Path(out) / "comparison.md").exists()
    assert main(["guide", str(tmp_path / "none.json"), "--out", str(tmp_path / "p.json")]) == 2
    assert "no such report" in capsys.readouterr().err


def test_compare_shows_per_layer_sqnr_and_where_the_winner_differs():
    """Layer 0 Gaussian, layer 1 heavy-tailed (cubed Gaussian): MXFP6 E2M3 wins the first by
    SQNR, MXFP8 E4M3 (more exponent range) the second. Layer SQNRs against float64 here."""
    from qtransform.formats import fake_quantize
    from qtransform.models import build_tiny
    from qtransform.scan import compare_formats

    model = build_tiny("qwen2", hidden=32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.model.layers[1].parameters():
            if p.ndim == 2:
                p.copy_(0.02 * torch.randn(p.shape, generator=g) ** 3)
    fmts = ["mxfp6_e2m3", "mxfp8_e4m3"]
    result = compare_formats(model, fmts)
    layers = {e["layer"]: e for e in result.per_layer()}
    for layer in (0, 1):
        weights = [p.detach() for n, p in model.model.layers[layer].named_parameters() if p.ndim == 2]
        for fmt in fmts:
            signal = sum(float(w.double().pow(2).sum()) for w in weights)
            error = sum(float((w.double() - fake_quantize(w, fmt).double()).pow(2).sum()) for w in weights)
            assert layers[layer]["sqnr_db"][fmt] == pytest.approx(10 * math.log10(signal / error), rel=1e-12)
    assert (layers[0]["winner"], layers[1]["winner"]) == ("mxfp6_e2m3", "mxfp8_e4m3")
    assert layers[None]["sites"] == 1  # lm_head, outside layers
    md = result.markdown()
    overall = result.winners["sqnr_db"]
    table = {line.split(" | ")[0].strip("| "): line for line in md.split("## Per layer")[1].splitlines()
             if line.startswith("| ") and not line.startswith("| layer")}
    for layer in (0, 1):
        row = table[str(layer)]
        assert row.endswith(f"| {layers[layer]['winner']}"
                            + (" (differs) |" if layers[layer]["winner"] != overall else " |"))
    assert json.loads(json.dumps(result.to_dict()))["layers"][1]["winner"] == "mxfp8_e4m3"


def test_a_stochastic_weight_scan_measures_the_transformed_models_first_draw():
    """One seeding scheme: the scan's stochastic rounding is the draw the transformed model's
    first forward makes for that weight (read here through `rollout_weights`), not a draw of
    its own."""
    import qtransform
    from qtransform.models import build_tiny
    from tests.helpers import metrics_f64

    model = build_tiny("qwen2")
    rule = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "rounding": "stochastic", "seed": 5}
    site = "model.layers.1.mlp.down_proj"
    q = qtransform.transform(model, {"version": 1, "quantize": [rule]})
    seen = dict(qtransform.rollout_weights(q))[f"{site}.weight"]
    w = model.get_submodule(site).weight
    row = next(r for r in scan_weights(model, policy={"version": 1, "quantize": [rule]}).rows if r.site == site)
    want = metrics_f64(w, seen)
    assert row.metrics["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9)
    assert row.metrics["deadzone"] == want["deadzone"] and row.options["seed"] == 5
    other = next(r for r in scan_weights(model, "mxfp4", options={"rounding": "stochastic", "seed": 6}).rows
                 if r.site == site)
    assert other.metrics["sqnr_db"] != row.metrics["sqnr_db"]  # another seed, another draw


@pytest.mark.parametrize("share", ["fused", [["re:.*layers\\.0\\.mlp\\.(gate|up|down)_proj"]]],
                         ids=["fused", "explicit"])
def test_a_shared_global_scale_is_scanned_as_the_transformed_model_quantizes(share):
    """`share_scale`: the scan quantizes each member of a group with the group's amax (the largest
    of the group), so its quantized weights are the transformed model's, bit for bit."""
    import qtransform
    from qtransform.formats.quantize import quantize_with_info
    from qtransform.models import build_tiny
    from qtransform.scan.seen import SeenWeights, scale_groups
    from qtransform.scan.sources import WeightRef, weight_refs
    from qtransform.scan.weights import policy_configs

    model = build_tiny("qwen2")
    rule = {"name": "w", "targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
            "nvfp4_variant": "compressed-tensors", "tensors": ["weight"], "share_scale": share}
    policy = {"version": 1, "quantize": [rule]}
    seen = dict(qtransform.rollout_weights(qtransform.transform(model, policy)))
    refs: list[WeightRef] = [r for r in weight_refs(model) if r.site.name != "lm_head"]
    view = SeenWeights.of(refs, groups=scale_groups(policy, [r.site for r in refs]))
    amax = {r.site.name: a for r in refs if (a := view.amax(r.site.name)) is not None}
    members = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert set(members) <= set(amax) and torch.equal(amax[members[0]], amax[members[1]])
    configs = policy_configs(policy, [r.site for r in refs])
    rows = {r.site: r for r in scan_weights(model, policy=policy).rows}
    alone = {r.site: r for r in scan_weights(model, policy={"version": 1, "quantize": [
        {**rule, "share_scale": "tensor"}]}).rows}
    differs = 0
    for ref in refs:
        name = ref.site.name
        w = ref.load()
        got = quantize_with_info(w, configs[name].bind(ref.site.reduction_axis), amax=amax.get(name))[0]
        assert torch.equal(got, seen[f"{name}.weight"]), name
        want = metrics_f64(w, seen[f"{name}.weight"])
        assert rows[name].metrics["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9), name
        differs += alone[name].metrics["sqnr_db"] != rows[name].metrics["sqnr_db"]
    assert differs  # the control: a scan with each weight's own scale measures other weights


def test_cli_weight_scan_of_a_checkpoint_takes_the_group_amax(tmp_path):
    """`qtransform scan --policy` on a safetensors checkpoint: a member of an explicit scale group
    is measured with the group's amax (q_proj's, the larger), not its own."""
    from qtransform import fake_quantize

    ckpt = qwen_checkpoint(tmp_path / "model.safetensors")
    rule = {"name": "w", "targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "tensors": ["weight"],
            "share_scale": [["re:model\\.layers\\.2\\.self_attn\\.(q|k)_proj"]]}
    (tmp_path / "p.json").write_text(json.dumps({"version": 1, "quantize": [rule]}))
    out = tmp_path / "scan"
    proc = run_cli("scan", str(ckpt), "--policy", str(tmp_path / "p.json"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    row = next(r for r in ScanReport.load(out).rows if r.site == "model.layers.2.self_attn.k_proj")
    with safe_open(ckpt, "pt") as f:
        q, k = f.get_tensor("model.layers.2.self_attn.q_proj.weight"), f.get_tensor("model.layers.2.self_attn.k_proj.weight")
    group = torch.maximum(q.abs().amax(), k.abs().amax())
    assert group > k.abs().amax()  # the group amax is not k's own: the check can fail
    want = metrics_f64(k, fake_quantize(k, "nvfp4", amax=group))
    own = metrics_f64(k, fake_quantize(k, "nvfp4"))
    assert row.metrics["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9)
    assert row.metrics["sqnr_db"] != pytest.approx(own["sqnr_db"], rel=1e-9)
