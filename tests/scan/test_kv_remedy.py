"""KV-cache remedies: an activation scan measures the finer KV scales (static per head, vLLM's
per token and head) on the keys and values its taps see, and `recommend` rewrites the KV rule to
the cheapest that clears the flagged rows, or keeps the sites out of it when none does.

Two planted models make the flags deterministic: one KV head of layer 0 a million times larger
(a per-tensor FP8 scale crushes the other heads: per head clears), and one token of layer 0 a
million times larger in every head (per head still crushes the other tokens: per token clears).
"""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import qtransform
from qtransform.models import build_tiny
from qtransform.passes.fake_quant import HeadwiseQuantize
from qtransform.scan.recommend import guide, recommend
from tests.formats.test_kv_writers import engine_writer
from tests.helpers import assert_metrics, metrics_f64, register_attention, with_implementation

KV = {"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "tensor"}
STATIC = {**KV, "scale_source": "static", "observer": "static_minmax"}
LINEAR = {"ignore": ["lm_head"], "format": "mxfp8_e4m3"}  # every Linear weight but the head
LAYER0 = "model.layers.0.self_attn"
SPECIAL, DIM = 7, 5  # the token made large, and the embedding dimension that carries it


def head_model() -> torch.nn.Module:
    """Layer 0's first KV head a million times larger (its k_proj / v_proj rows and biases)."""
    model = build_tiny("qwen2", hidden=128)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight[:attn.head_dim] *= 1e6
            proj.bias[:attn.head_dim] *= 1e6
    return model


def token_model() -> torch.nn.Module:
    """Token SPECIAL's layer-0 keys and values a million times larger in every head: only its
    embedding has dimension DIM, which k_proj / v_proj weigh a million times more."""
    model = build_tiny("qwen2", hidden=128)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, DIM] = 0.0
        emb[SPECIAL, DIM] = 1e3 * emb[SPECIAL].abs().max()
        for proj in (attn.k_proj, attn.v_proj):
            proj.weight[:, DIM] *= 1e6
    return model


def batch(special: bool = False) -> torch.Tensor:
    ids = torch.randint(8, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    if special:
        ids[:, 3] = SPECIAL
    return ids


def scanned(model: torch.nn.Module, rules: list[dict] | dict, ids: torch.Tensor) -> qtransform.scan.ScanReport:
    """The activation scan of `rules` (or a whole policy), flagged by the absolute limits."""
    policy = rules if isinstance(rules, dict) else {"version": 1, "quantize": rules}
    report = qtransform.scan_activations(model, policy, ids, batch_size=2, token_stride=1)
    report.flagging = "absolute"  # a two-layer model has too few sites for robust outliers
    return report


def layer0_kv(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Layer 0's keys and values at its attention call, batch by batch as the scan runs them
    (layer 0 sees no quantized tensor upstream), read by an attention function registered here."""
    seen: dict[str, list[torch.Tensor]] = {"key": [], "value": []}

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            seen["key"].append(key.detach().clone())
            seen["value"].append(value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    reader = with_implementation(model, register_attention("kv-remedy-reader", attention))
    with torch.no_grad():
        for part in ids.split(2):
            reader(part)
    return {k: torch.cat(v) for k, v in seen.items()}


def fp8_with_amax(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 as compressed-tensors writes it, x / (amax / 448) rounded to nearest even."""
    scale = amax.float() / 448.0
    return torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def row(report, site: str, point: str):
    return next(r for r in report.rows if r.site == site and r.point == point)


def unsaturated(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics but saturation, which a remedy does not measure."""
    return {k: v for k, v in metrics.items() if not k.startswith("saturat")}


def test_remedies_equal_the_same_tensors_quantized_independently():
    """Per head: one static_minmax amax per head over every batch, as the rule's observer;
    per token and head: vLLM's writer, step by step. Same tensors, same metrics (float64 sums)."""
    model, ids = head_model(), batch()
    report = scanned(model, [STATIC], ids)
    kv = layer0_kv(model, ids)
    for point, x in kv.items():
        got = row(report, LAYER0, point).remedies
        assert list(got) == ["fp8_e4m3 per head, static static_minmax",
                             "fp8_e4m3 per token and head (vLLM fp8_per_token_head)"]
        heads = torch.cat([fp8_with_amax(x[:, h], x[:, h].abs().amax()).unsqueeze(1)
                           for h in range(x.shape[1])], dim=1)
        per_token = engine_writer(x, "fp8")
        for entry, q in zip(got.values(), (heads, per_token), strict=True):
            want = metrics_f64(x, q)
            want.pop("mean_rel_error")
            assert_metrics(entry["metrics"], want)
        assert got["fp8_e4m3 per head, static static_minmax"]["fields"] == {
            "granularity": "head", "scale_source": "static", "observer": "static_minmax"}
    assert row(report, LAYER0, "key").metrics["deadzone"] == pytest.approx(0.75, abs=0.01)  # 3 of 4 heads


def test_per_head_when_it_clears_and_the_policy_quantizes_as_measured():
    """The head planted: per head clears layer 0's keys and values; the KV rule becomes
    llm-compressor's attn_head (static per head, minmax); the layer's Linear sites stay
    quantized; re-scanned, layer 0 measures what the remedy did."""
    model, ids = head_model(), batch()
    report = scanned(model, [LINEAR, KV], ids)
    flagged = {(r.site, r.point) for r, _ in report.problems()}
    assert flagged == {(LAYER0, "key"), (LAYER0, "value")}
    rec = recommend(report)
    assert rec.kind == "kv_cache" and rec.kept_layers == [] and rec.kept_sites == []
    assert rec.policy["quantize"][0] == LINEAR and "engine" not in rec.policy
    assert rec.policy["quantize"][1] == {"targets": ["Attention"], **KV, "granularity": "head",
                                         "scale_source": "static", "observer": "minmax"}
    assert "fp8_e4m3 per head, static minmax clears 2 flagged key/value rows" in rec.text
    assert "attn_head" in rec.text and "no extra bit per element" in rec.text
    assert rec.kv_cache == [{"rule": 1, "alternative": "fp8_e4m3 per head, static minmax",
                             "rows": [f"{LAYER0} [key]", f"{LAYER0} [value]"], "kept": []}]
    assert guide(report) == rec.policy
    out = qtransform.transform(model, rec.policy, calibration=list(ids.split(2)))
    headwise = [m for m in out.modules() if isinstance(m, HeadwiseQuantize)]
    assert len(headwise) == 4 and all(len(m.heads) == 4 for m in headwise)  # 2 layers x key, value
    again = scanned(model, rec.policy, ids)
    assert not [r for r, _ in again.problems() if r.kind == "attention"]
    for point in ("key", "value"):
        measured = row(report, LAYER0, point).remedies["fp8_e4m3 per head, static minmax"]["metrics"]
        assert unsaturated(row(again, LAYER0, point).metrics) == unsaturated(measured)


def test_per_token_only_when_per_head_does_not_clear():
    """The token planted: per head leaves the other tokens crushed, so the KV rule becomes vLLM's
    fp8_per_token_head writer with its engine section; the text names its cost and engine."""
    model, ids = token_model(), batch(special=True)
    report = scanned(model, [KV], ids)
    for point in ("key", "value"):
        kv_row = row(report, LAYER0, point)
        assert report.row_problems(kv_row)
        assert kv_row.remedies["fp8_e4m3 per head, static minmax"]["metrics"]["deadzone"] > 0.9
    rec = recommend(report)
    assert rec.kind == "kv_cache"
    assert rec.policy["quantize"] == [{"targets": ["Attention"], "format": "fp8_e4m3", "tensors": ["key", "value"],
                                       "fp8_variant": "vllm-per-token-head", "granularity": "token",
                                       "scale_source": "dynamic"}]
    assert rec.policy["engine"] == {"name": "vllm", "backend": "triton", "kv_cache_dtype": "fp8_per_token_head"}
    assert "per token and head (vLLM fp8_per_token_head) clears 2" in rec.text
    assert "no checkpoint scale" in rec.text and "vLLM's Triton attention only" in rec.text
    again = scanned(model, rec.policy, ids)  # the engine's Triton kernel reads the cache
    for point in ("key", "value"):
        measured = row(report, LAYER0, point).remedies["fp8_e4m3 per token and head (vLLM fp8_per_token_head)"]
        assert unsaturated(row(again, LAYER0, point).metrics) == unsaturated(measured["metrics"])


def test_no_rung_clears_keeps_the_sites_out_of_the_kv_rule():
    """Limits no FP8 scale meets: the flagged attention sites leave the KV rule (16-bit keys and
    values), their layers' Linear sites stay quantized, and the policy transforms the model."""
    model, ids = head_model(), batch()
    report = scanned(model, [LINEAR, KV], ids)
    report.thresholds["sqnr_db"] = 60.0
    rec = recommend(report)
    sites = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert rec.policy["quantize"] == [LINEAR]  # the KV rule quantizes no site left: it goes
    assert rec.kept_sites == sites and rec.kept_layers == []
    assert f"No measured KV scales clear {', '.join(sites)}" in rec.text and "go." in rec.text
    plan = qtransform.plan(model, rec.policy)
    assert not {r.site for r in plan.rows if r.pass_name == "fake_quant"} & set(sites)

