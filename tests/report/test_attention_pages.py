"""Attention sites on the HTML pages: a KV scan's rows (each head's SQNR beside the site's) and a
sensitivity report's attention rows (with the points they quantize)."""

from __future__ import annotations

import torch

from qtransform.models import build_tiny
from qtransform.report.scan_pages import scan_page, sensitivity_page
from qtransform.scan.activations import scan_activations
from qtransform.scan.sensitivity import site_sensitivity

KV = {"targets": ["Attention"], "format": "fp8_e5m2", "tensors": ["key", "value"], "granularity": "head"}
POLICY = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}, KV]}


def calib() -> torch.Tensor:
    return torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))


def test_scan_page_shows_attention_rows_and_their_heads(tmp_path):
    report = scan_activations(build_tiny("qwen2"), POLICY, calib(), token_stride=1)
    html = scan_page(report).write(tmp_path / "report.html").read_text()
    rows = [r for r in report.rows if r.kind == "attention"]
    assert {(r.site, r.point) for r in rows} == {(f"model.layers.{i}.self_attn", p)
                                                 for i in (0, 1) for p in ("key", "value")}
    assert "SQNR dB per head" in html
    for r in rows:
        per_head = ", ".join(f"{h['metrics']['sqnr_db']:.2f}" for h in r.heads)
        assert len(r.heads) == 2 and per_head in html


def test_sensitivity_page_shows_attention_sites_with_their_points(tmp_path):
    report = site_sensitivity(build_tiny("qwen2"), POLICY, calib())
    html = sensitivity_page(report).write(tmp_path / "sensitivity.html").read_text()
    attention = [r for r in report.rows if r.role == "attention"]
    assert [r.site for r in attention] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(r.site in html for r in attention) and "key+value" in html
