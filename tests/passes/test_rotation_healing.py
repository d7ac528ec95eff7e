"""Outlier healing: a 32-wide Hadamard rotation before MXFP4 W4A4 on a tiny Qwen2
with four planted outlier input channels cuts the next-token KL, and an activation scan reports
the same sites with and without it side by side (taps measure the rotated tensors). The model
and the figures are those of benches/bench_rotation_healing.py (docs/benchmarks.md)."""

from __future__ import annotations

import torch

from benches.bench_rotation_healing import next_token_kl, planted_outliers, policy
from qtransform.scan.activations import scan_activations

IDS = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
H32 = {"kind": "hadamard", "block_size": 32}


def test_a_hadamard_rotation_heals_planted_outlier_channels():
    model = planted_outliers()
    plain = next_token_kl(model, policy(None, ["lm_head"]), IDS)
    rotated = next_token_kl(model, policy(H32, ["lm_head"]), IDS)
    assert plain > 0.15  # the outliers hurt: 0.199 measured
    assert rotated < 0.4 * plain  # 0.061 measured
    # without outliers the same model loses far less, so the gain is the outliers' doing
    assert next_token_kl(planted_outliers(factor=1.0), policy(None, ["lm_head"]), IDS) < 0.5 * plain


def test_a_scan_reports_the_same_sites_with_and_without_the_rotation():
    model = planted_outliers()
    reports = {name: scan_activations(model, policy(rotation, ["lm_head"]), IDS[:2, :32])
               for name, rotation in (("plain", None), ("rotated", H32))}
    rows = {name: {(r.site, r.point): r for r in report.rows} for name, report in reports.items()}
    assert rows["plain"].keys() == rows["rotated"].keys()
    site = ("model.layers.0.self_attn.q_proj", "input")
    # the outlier channels flush their blocks without the rotation; rotated, the quantization
    # error of x·R against x·R is that of a well-spread block
    assert rows["rotated"][site].metrics["sqnr_db"] > rows["plain"][site].metrics["sqnr_db"] + 3


def test_a_weight_scan_of_a_rotating_policy_measures_what_the_taps_see():
    """scan_weights reads the weights, never runs the model: with a rotate rule it measures the
    rotated weight, the very tensor the transformed model's weight tap compares."""
    import qtransform
    from qtransform.scan.weights import scan_weights

    model = planted_outliers()
    pol = {**policy(H32, ["lm_head"]), "instrument": {"points": ["weight"]}}
    scanned = {r.site: r for r in scan_weights(model, policy=pol).rows}
    transformed = qtransform.transform(model, pol)
    with torch.no_grad():
        transformed(input_ids=IDS[:1, :8])
    taps = {m.site: m.result()["quant"] for m in transformed.modules() if type(m).__name__ == "Tap"}
    site = "model.layers.1.mlp.up_proj"
    assert scanned[site].metrics["sqnr_db"] == taps[site]["sqnr_db"]
    plain = {r.site: r for r in scan_weights(model, policy=policy(None, ["lm_head"])).rows}
    assert scanned[site].metrics["sqnr_db"] > plain[site].metrics["sqnr_db"] + 3  # healed
