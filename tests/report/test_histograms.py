"""The page's per-site histograms show the tensor the transformed model quantizes: W·R on a
rotated site, and on a site whose NVFP4 global scale is shared (q/k/v fused) the group's amax; the
weight scan measures the same tensor, so the page and the scan cannot disagree."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.core.metrics import ErrorStats
from qtransform.models import build_tiny
from qtransform.report.histograms import BINS, _hist, site_histograms
from qtransform.scan.weights import scan_weights

NVFP4 = {"format": "nvfp4", "nvfp4_variant": "compressed-tensors", "tensors": ["weight"]}
CASES = {
    "rotated": ({"version": 1,
                 "rotate": [{"targets": ["re:.*layers\\.0\\.mlp\\.down_proj"], "block_size": 32}],
                 "quantize": [{"name": "w", "targets": ["Linear"], "ignore": ["lm_head"],
                               "format": "mxfp4", "tensors": ["weight"]}]},
                ["model.layers.0.mlp.down_proj"]),
    "fused-nvfp4": ({"version": 1, "quantize": [{"name": "w", "targets": ["Linear"], "ignore": ["lm_head"],
                                                  **NVFP4, "share_scale": "fused"}]},
                    ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                     "model.layers.0.self_attn.v_proj"]),
}


def _quantized_by_model(policy: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor the site's weight fake quantizer is given, what it returns), read from the
    transformed model's own modules: its weight rotation, then its fake quant (group amax)."""
    site = qtransform.transform(build_tiny("qwen2"), policy).get_submodule(name)
    with torch.no_grad():
        w = site.weight.detach()
        rotate = site._modules.get("weight_rotate")
        seen = rotate.rotate_weight(w) if rotate is not None else w
        return seen, site.weight_fake_quant.quantize(seen)


@pytest.mark.parametrize("case", list(CASES))
def test_the_page_histograms_quantize_what_the_model_and_the_scan_quantize(case):
    policy, names = CASES[case]
    model = build_tiny("qwen2")
    report = scan_weights(model, policy=policy)
    hists = site_histograms(model, report)
    rows = {r.site: r for r in report.rows}
    for name in names:
        seen, xq = _quantized_by_model(policy, name)
        if case == "rotated":  # the control: the page must not bin the stored W
            assert not torch.equal(seen, model.get_submodule(name).weight)
        want = {"weight": _hist(seen, BINS), "error": _hist(xq.float() - seen.float(), BINS)}
        assert hists[name] == want, name
        # the scan measured the same pair: its error sums equal the model's, bit for bit
        # (saturation counts need the quantizer's own flags, which the model does not return)
        model_sums = ErrorStats().update(seen, xq).state()
        assert {k: v for k, v in rows[name].state.items() if not k.startswith("saturat")} == {
            k: v for k, v in model_sums.items() if not k.startswith("saturat")}, name


def test_the_shared_scale_changes_what_a_member_quantizes():
    """The control of the fused case: k_proj's own global scale quantizes it to other values, so
    the histogram test above sees the shared amax."""
    policy, names = CASES["fused-nvfp4"]
    alone = {**policy, "quantize": [{**policy["quantize"][0], "share_scale": "tensor"}]}
    differs = [not torch.equal(_quantized_by_model(policy, n)[1], _quantized_by_model(alone, n)[1])
               for n in names]
    assert sum(differs) >= 1
