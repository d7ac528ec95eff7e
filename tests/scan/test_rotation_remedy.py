"""A rotation as the remedy for flagged sites (scan/remedy.py): measured by the weight scan and
`compare`, weighed by `recommend`/`guide` against higher precision, on a tiny Qwen2 with planted
outlier input channels and on its Gaussian twin. Expected values come from the dense reference
rotation (`hadamard.rotate`, a matmul) and float64 metrics, not from the fast path under test."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qtransform.errors import UserError
from qtransform.formats import fake_quantize
from qtransform.formats import hadamard as H
from qtransform.models import build_tiny
from qtransform.scan import compare_formats, guide, recommend, scan_weights
from qtransform.scan.remedy import Rotation
from qtransform.scan.report import ScanReport

PLANTED = "model.layers.2.mlp.down_proj"
OUTLIERS = [3, 40, 77, 100]  # input channels of the planted site, 40x the others


def planted() -> torch.nn.Module:
    model = build_tiny("qwen2", num_layers=4, hidden=64)
    with torch.no_grad():
        model.get_submodule(PLANTED).weight[:, OUTLIERS] *= 40
    return model


def sqnr_db(w: torch.Tensor, wq: torch.Tensor) -> float:
    w, wq = w.double(), wq.double()
    return 10 * math.log10(float((w * w).sum() / ((w - wq) ** 2).sum()))


def reference_sqnr(w: torch.Tensor, rotation: Rotation | None, fmt: str = "mxfp4") -> float:
    """The format's SQNR on W (rotation None) or on W·R: the rotated weight brought back to the
    original basis, Q(W·R)·Rᵀ, against W, all from the dense reference rotation."""
    if rotation is None:
        return sqnr_db(w, fake_quantize(w, fmt))
    b = rotation.block_size
    signs = H.random_signs(b, rotation.seed) if rotation.kind == "random_hadamard" else None
    q = fake_quantize(H.rotate(w, b, signs), fmt).double()
    back = (q.reshape(*w.shape[:-1], -1, b) @ H.hadamard_matrix(b, torch.float64)).reshape(w.shape)
    if signs is not None:
        back = (back.reshape(*w.shape[:-1], -1, b) * signs.double()).reshape(w.shape)
    return sqnr_db(w, back)


@pytest.mark.parametrize("spec", ["hadamard-32", "random_hadamard-32:5"])
def test_scan_measures_the_rotated_error_of_every_site(spec):
    model = planted()
    rotation = Rotation.parse(spec)
    report = scan_weights(model, "mxfp4", rotation=spec)
    rows = {r.site: r for r in report.rows}
    weight = model.get_submodule(PLANTED).weight.detach()
    assert rows[PLANTED].metrics["sqnr_db"] == pytest.approx(reference_sqnr(weight, None), abs=1e-9)
    rotated = rows[PLANTED].remedies[rotation.label]["metrics"]["sqnr_db"]
    assert rotated == pytest.approx(reference_sqnr(weight, rotation), abs=0.02)
    # the planted outliers crush their neighbours to zero; spread over their blocks they do not:
    # measured 16.0 -> 19.2 dB (error energy / 2.1) and the deadzone / 6
    assert rotated - rows[PLANTED].metrics["sqnr_db"] > 2.5
    dead = rows[PLANTED].remedies[rotation.label]["metrics"]["deadzone"]
    assert dead < rows[PLANTED].metrics["deadzone"] / 4
    plain = rows["model.layers.1.mlp.down_proj"]  # Gaussian: no gain to speak of
    assert abs(plain.remedies[rotation.label]["metrics"]["sqnr_db"] - plain.metrics["sqnr_db"]) < 0.5
    assert report.meta["rotation"] == rotation.label


def test_remedies_survive_save_and_load(tmp_path):
    report = scan_weights(build_tiny("qwen2", num_layers=2, hidden=64), "mxfp4", rotation="hadamard-32")
    report.save(tmp_path)
    back = ScanReport.load(tmp_path)
    assert [r.remedies for r in back.rows] == [r.remedies for r in report.rows]
    assert all(r.remedies and r.remedies["hadamard-32"]["state"] for r in back.rows)
    md = (tmp_path / "report.md").read_text()
    assert "## Rotation remedy: hadamard-32" in md and "| model.layers.1.mlp.down_proj |" in md


def test_compare_puts_the_rotated_format_beside_each_format():
    model = planted()
    result = compare_formats(model, ["mxfp4", "nvfp4"], rotation="hadamard-32")
    assert result.formats == ["mxfp4", "mxfp4 with hadamard-32", "nvfp4", "nvfp4 with hadamard-32"]
    layer2 = next(e for e in result.per_layer() if e["layer"] == 2)
    assert layer2["sqnr_db"]["mxfp4 with hadamard-32"] > layer2["sqnr_db"]["mxfp4"] + 2.0
    rows = {r.site: r for r in result.reports["mxfp4 with hadamard-32"].rows}
    weight = model.get_submodule(PLANTED).weight.detach()
    assert rows[PLANTED].metrics["sqnr_db"] == pytest.approx(
        reference_sqnr(weight, Rotation("hadamard", 32)), abs=0.02)
    assert result.reports["mxfp4 with hadamard-32"].meta["rotation"] == "hadamard-32"
    assert "mxfp4 with hadamard-32" in result.markdown()


def test_compare_counts_sites_the_rotation_does_not_fit_unrotated():
    """A 64-wide axis cannot take a 128-wide block: the site counts unrotated, and a note says so."""
    model = build_tiny("qwen2", num_layers=1, hidden=64)
    result = compare_formats(model, ["mxfp4"], rotation="hadamard-128")
    plain, rotated = result.reports["mxfp4"], result.reports["mxfp4 with hadamard-128"]
    fits = {r.site for r in plain.rows if r.shape[-1] % 128 == 0}  # down_proj: 128 inputs
    assert fits and len(fits) < len(plain.rows)
    for a, b in zip(plain.rows, rotated.rows, strict=True):
        assert (a.metrics == b.metrics) == (a.site not in fits)
    assert any(f"does not fit the reduction axis of {len(plain.rows) - len(fits)} of" in n for n in result.notes)


@pytest.mark.parametrize("text", ["hadamard-24", "spin-32", "hadamard-32:3", "hadamard-"])
def test_a_bad_rotation_names_the_syntax(text):
    with pytest.raises(UserError, match="KIND-BLOCK"):
        Rotation.parse(text)


def test_whole_axis_rotation_label_round_trips():
    assert Rotation.parse("hadamard") == Rotation("hadamard", None) == Rotation.parse("hadamard-axis")
    assert Rotation.parse(Rotation("random_hadamard", 64, 7).label) == Rotation("random_hadamard", 64, 7)


def test_recommend_rotates_the_planted_site_instead_of_a_wider_format():
    """Flagged for its deadzone, healed by the rotation: the recommendation rotates it (no bit)
    rather than keeping it in high precision (+11.75 bits per weight) or moving to MXFP8 (+4)."""
    model = planted()
    report = scan_weights(model, "mxfp4", rotation="hadamard-32")
    assert [r.site for r, _ in report.problems()] == [PLANTED]
    assert recommend(scan_weights(model, "mxfp4")).kept_sites  # without the rotation: kept in bf16
    rec = recommend(report)
    assert rec.kind == "rotate" and rec.rotated_sites == [PLANTED] and rec.kept_sites == []
    assert rec.policy["rotate"] == [{"name": "remedy hadamard-32", "targets": [PLANTED],
                                     "kind": "hadamard", "block_size": 32}]
    assert "ignore" not in rec.policy["quantize"][0] or rec.policy["quantize"][0]["ignore"] == []
    assert "no extra bit" in rec.text and "11.75 more bits per weight" in rec.text
    assert "4.00 more in mxfp8_e4m3" in rec.text


def test_the_rotated_policy_heals_the_site_in_the_transformed_model():
    """The guide's policy, applied by the rotate pass: the planted site's weight as the model
    now computes it (fake-quantized W·R, rotated back) has the rotated error the scan reported."""
    from qtransform import transform

    model = planted()
    report = scan_weights(model, "mxfp4", rotation="hadamard-32")
    policy = guide(report)
    out = transform(model, policy)
    x = torch.eye(128)  # the site's 128 inputs, one at a time: rows of W_effᵀ
    site = out.get_submodule(PLANTED)
    with torch.no_grad():
        w_eff = site(x).T  # [out, in]
    weight = model.get_submodule(PLANTED).weight.detach()
    rotated = next(r for r in report.rows if r.site == PLANTED).remedies["hadamard-32"]["metrics"]["sqnr_db"]
    assert sqnr_db(weight, w_eff) == pytest.approx(rotated, abs=0.05)


def test_gaussian_weights_get_no_rotation_even_when_flagged():
    """A strict absolute SQNR limit flags every MXFP4 site of the Gaussian model; a rotation
    gains nothing on Gaussian weights, so only more bits help: the usual format change."""
    report = scan_weights(build_tiny("qwen2", num_layers=4, hidden=64), "mxfp4", rotation="hadamard-32",
                          flagging="absolute", thresholds={"sqnr_db": 25.0})
    assert len(report.problems()) == len(report.rows)
    rec = recommend(report)
    assert rec.kind == "change_format" and rec.rotated_sites == [] and "rotate" not in rec.policy
    unflagged = scan_weights(build_tiny("qwen2", num_layers=4, hidden=64), "mxfp4", rotation="hadamard-32")
    assert unflagged.problems() == [] and "rotate" not in recommend(unflagged).policy


def test_guide_cli_writes_the_rotate_rule(tmp_path, capsys):
    from qtransform.cli.main import main

    model_dir = tmp_path / "model"
    planted().save_pretrained(model_dir)
    assert main(["scan", str(model_dir), "--format", "mxfp4", "--rotation", "hadamard-32",
                 "--out", str(tmp_path / "scan")]) == 0
    capsys.readouterr()
    assert main(["guide", str(tmp_path / "scan"), "--out", str(tmp_path / "policy.json")]) == 0
    policy = json.loads((tmp_path / "policy.json").read_text())
    assert policy["rotate"][0]["targets"] == [PLANTED]
    assert "heals 1 flagged site" in capsys.readouterr().err
    assert main(["scan", str(model_dir), "--format", "mxfp4", "--rotation", "hadamard-24",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "KIND-BLOCK" in capsys.readouterr().err


ACT_SITES = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]


def act_outliers() -> torch.nn.Module:
    """Four input channels of layer 1's attention 30x larger (its input norm's weight): the
    activation outliers a rotation is for."""
    model = build_tiny("qwen2", num_layers=2, hidden=64)
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[[3, 17, 40, 51]] *= 30
    return model


def hand_rotated_kl(model: torch.nn.Module, site: str, ids: torch.Tensor) -> float:
    """KL(fp‖q) per token with only `site` W4A4 MXFP4 after a dense 32-wide Hadamard rotation of
    its input and weight, written out by hand (F.linear on the rotated, quantized operands)."""
    import torch.nn.functional as F

    linear = model.get_submodule(site)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.double()
        wq = fake_quantize(H.rotate(linear.weight, 32), "mxfp4")
        handle = linear.register_forward_hook(
            lambda mod, args, out: F.linear(fake_quantize(H.rotate(args[0], 32), "mxfp4"), wq, mod.bias))
        try:
            got = model(input_ids=ids, use_cache=False).logits.double()
        finally:
            handle.remove()
    logp, logq = ref.log_softmax(-1), got.log_softmax(-1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


def test_sensitivity_measures_each_site_with_and_without_the_rotation(tmp_path):
    from qtransform.scan.sensitivity import site_sensitivity
    from qtransform.scan.sensitivity_report import SensitivityReport

    model = act_outliers()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    report = site_sensitivity(model, "mxfp4", ids, activations=True, rotation="hadamard-32")
    rows = {r.site: r for r in report.rows}
    assert report.meta["rotation"] == "hadamard-32"
    for site in ACT_SITES:  # the outlier inputs: the rotation lowers their KL
        assert rows[site].rotated < rows[site].exact, site
        # equal to the hand-written rotation apart from rounding-boundary ties of the fp32 paths
        assert rows[site].rotated == pytest.approx(hand_rotated_kl(model, site, ids), rel=1e-4)
    report.save(tmp_path)
    back = SensitivityReport.load(tmp_path)
    assert [r.rotated for r in back.ranked()] == [r.rotated for r in report.ranked()]
    assert "| with hadamard-32 | rotated / exact |" in (tmp_path / "sensitivity.md").read_text()
    with pytest.raises(UserError, match="rotated measure is exact"):
        site_sensitivity(model, "mxfp4", ids, method="estimate", rotation="hadamard-32")


def test_sensitivity_cli_takes_a_rotation(tmp_path, capsys):
    from qtransform.cli.main import main

    act_outliers().save_pretrained(tmp_path / "model")
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2)).tolist()))
    assert main(["sensitivity", str(tmp_path / "model"), "--format", "mxfp4", "--activations",
                 "--calib", str(calib), "--rotation", "hadamard-32", "--out", str(tmp_path / "s")]) == 0
    assert "with hadamard-32" in capsys.readouterr().out
    rows = json.loads((tmp_path / "s" / "sensitivity.json").read_text())["rows"]
    assert all(isinstance(r["rotated"], float) for r in rows)


def test_compare_cli_takes_a_rotation(tmp_path, capsys):
    from qtransform.cli.main import main

    assert main(["compare", "builtin:qwen2", "--formats", "mxfp4,nvfp4", "--rotation", "hadamard-32",
                 "--out", str(tmp_path / "c")]) == 0
    assert "| sqnr_db | " in capsys.readouterr().out
    data = json.loads((tmp_path / "c" / "comparison.json").read_text())
    assert data["formats"] == ["mxfp4", "mxfp4 with hadamard-32", "nvfp4", "nvfp4 with hadamard-32"]
    assert main(["compare", "builtin:qwen2", "--formats", "mxfp4", "--rotation", "givens-4"]) == 2
    assert "KIND-BLOCK" in capsys.readouterr().err
