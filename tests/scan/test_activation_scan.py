"""Activation scan and the SRDD fault scans: streamed metrics equal direct float64 computations."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from torch import nn

import qtransform
from qtransform import fake_quantize
from qtransform.calibration import builtin_calibration, calibration_batches, read_calibration
from qtransform.cli.main import main
from qtransform.errors import UserError
from qtransform.scan.activations import scan_activations
from qtransform.scan.faults import gain_scan, instability_scan, kurtosis_scan, stochastic_policy
from qtransform.scan.measure import EndToEnd, SitePairs
from qtransform.scan.setup import auto_stride, resolve_policy
from tests.conftest import ids
from tests.helpers import assert_untouched, snapshot

W4A16 = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]}
W16A4 = {"version": 1, "quantize": [
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["input"]}]}
FIRST = "model.layers.0.self_attn.q_proj"


def _ragged(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Token-id samples of three lengths: batches of equal length, never padded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (5 + 3 * (i % 3),), generator=g).tolist() for i in range(n)]


def _outputs(model: nn.Module, names: list[str], batches: list[torch.Tensor], *, inputs: bool = False):
    """Every batch's input or output of the named sites, concatenated (plain forward hooks)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = []
    for name in names:
        def hook(m, args, out, name=name):
            value = args[0] if inputs else out
            seen[name].append(value.detach().reshape(-1, value.shape[-1]).double())
        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    for h in hooks:
        h.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


def _sqnr(x: torch.Tensor, xq: torch.Tensor) -> float:
    return 10 * math.log10(float(x.pow(2).sum() / (x - xq).pow(2).sum()))


@pytest.mark.parametrize("policy", [W4A16, W16A4], ids=["W4A16", "W16A4"])
def test_accumulated_and_input_metrics_equal_direct_float64(tiny, policy):
    model = tiny("qwen2")
    samples = _ragged()
    before = snapshot(model)
    report = scan_activations(model, policy, samples, batch_size=2, token_stride=1)
    assert_untouched(before, model)
    batches = calibration_batches(samples, batch_size=2)
    assert len(batches) == 3 and report.meta["calibration"]["batches"] == 3
    accumulated = {e["site"]: e["metrics"] for e in report.meta["accumulated"]}
    names = list(accumulated)
    assert len(names) == 14 and "lm_head" not in names
    fp = _outputs(model, names, batches)
    quant = _outputs(qtransform.transform(model, policy), names, batches)
    for name in names:
        got = accumulated[name]
        assert got["n"] == fp[name].numel()
        assert got["sqnr_db"] == pytest.approx(_sqnr(fp[name], quant[name]), rel=1e-10)
        assert got["max_abs_error"] == float((fp[name] - quant[name]).abs().max())
    rows = {(r.site, r.point): r for r in report.rows}
    if policy is W16A4:
        x = _outputs(model, names, batches, inputs=True)[FIRST].float()  # same input: first site
        assert rows[FIRST, "input"].metrics["sqnr_db"] == pytest.approx(
            _sqnr(x.double(), fake_quantize(x, "mxfp4").double()), rel=1e-10)
        assert (FIRST, "weight") not in rows
    else:
        assert (FIRST, "input") not in rows and (FIRST, "weight") in rows


@pytest.mark.parametrize("policy", [W4A16, W16A4], ids=["W4A16", "W16A4"])
def test_local_error_of_first_quantized_site_equals_its_accumulated_error(tiny, policy):
    report = scan_activations(tiny("qwen2"), policy, _ragged(4), batch_size=4, token_stride=1)
    local = next(r for r in report.rows if r.site == FIRST and r.point == "output")
    accumulated = next(e for e in report.meta["accumulated"] if e["site"] == FIRST)
    assert local.metrics == accumulated["metrics"]
    later = "model.layers.1.mlp.down_proj"  # downstream errors add up: accumulated is worse
    local = next(r for r in report.rows if r.site == later and r.point == "output")
    accumulated = next(e for e in report.meta["accumulated"] if e["site"] == later)
    assert accumulated["metrics"]["sqnr_db"] < local.metrics["sqnr_db"]


def test_token_stride_measures_every_kth_token_of_the_stream(tiny):
    """A sample is every k-th token row of the whole stream (across batches of any shape), the
    same rows for taps, accumulated pairs and the final output."""
    model = tiny("qwen2")
    samples = _ragged(7)
    report = scan_activations(model, W16A4, samples, batch_size=2, token_stride=3)
    batches = calibration_batches(samples, batch_size=2)
    names = [FIRST, "model.layers.1.mlp.down_proj"]
    fp = _outputs(model, names, batches)
    quant = _outputs(qtransform.transform(model, W16A4), names, batches)
    accumulated = {e["site"]: e["metrics"] for e in report.meta["accumulated"]}
    for name in names:
        a, b = fp[name][::3], quant[name][::3]
        assert accumulated[name]["n"] == a.numel()
        assert accumulated[name]["sqnr_db"] == pytest.approx(_sqnr(a, b), rel=1e-10)
    x = _outputs(model, [FIRST], batches, inputs=True)[FIRST][::3].float()
    rows = {(r.site, r.point): r.metrics for r in report.rows}
    assert rows[FIRST, "input"]["sqnr_db"] == pytest.approx(
        _sqnr(x.double(), fake_quantize(x, "mxfp4").double()), rel=1e-10)
    assert rows[FIRST, "output"]["sqnr_db"] == pytest.approx(accumulated[FIRST]["sqnr_db"], rel=1e-6)
    end = report.meta["end_to_end"]
    total = sum(b.numel() for b in batches)
    assert end["tokens"] == total and end["measured_tokens"] == len(range(0, total, 3))


def test_perplexity_equals_exp_of_hf_loss(tiny):
    model = tiny("qwen2")
    x = ids(4, 12)
    end = scan_activations(model, W4A16, x, batch_size=2, token_stride=1).meta["end_to_end"]
    quant = qtransform.transform(model, W4A16)
    with torch.no_grad():
        for name, m in (("fp", model), ("quant", quant)):
            losses = [float(m(input_ids=b, labels=b).loss) for b in x.split(2)]
            loss = sum(losses) / len(losses)  # equal token counts per batch
            assert end[f"loss_{name}"] == pytest.approx(loss, rel=1e-6)
            assert end[f"perplexity_{name}"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert end["predicted_tokens"] == 4 * 11 and end["tokens"] == 48


def test_streaming_state_is_constant_in_the_number_of_batches(tiny):
    model = tiny("qwen2")
    program = qtransform.transform_program(model, resolve_policy(model, W4A16))
    quant = program.module()
    sites = list(program.sites)[:-1]
    sizes = []
    with SitePairs(model, quant, sites) as pairs, torch.no_grad():
        end = EndToEnd(causal=True)
        for batch in calibration_batches(ids(12, 8), batch_size=2):
            fp_out, q_out = model(input_ids=batch), quant(input_ids=batch)
            pairs.end_batch()
            end.update(batch, fp_out, q_out)
            assert not any(pairs._pending.values())  # nothing of the batch is kept
            sizes.append(len(pickle.dumps((pairs.stats, end.__dict__))))
    assert len(sizes) == 6 and len(set(sizes)) == 1


def test_demo_model_on_two_sentences():
    from qtransform.models import load_model, load_tokenizer

    model = load_model("demo")
    report = scan_activations(model, "mxfp4", builtin_calibration()[:2],
                              tokenizer=load_tokenizer("demo"))
    end = report.meta["end_to_end"]
    assert "perplexity_fp" not in end and end["output"] == "final output"
    assert 0.9 < end["mean_token_cosine"] < 1.0 and math.isfinite(end["sqnr_db"])
    sites = {r.site for r in report.rows}
    assert len(sites) == 6 * 6 + 1  # six linears per layer and the pooler
    assert json.loads(report.to_json())["meta"]["kind"] == "activation_scan"
    assert report.meta["calibration"]["token_stride"] == 1  # a small set is measured whole
    assert [auto_stride(n) for n in (300, 2048, 8192, 10**6)] == [1, 2, 8, 16]


def _deadzone_model() -> tuple[nn.Module, torch.Tensor]:
    """Two linears; the first quantizes its input with MXFP4. Each block of 32 input elements
    holds one 6.0 (scale 1) and 31 values of 0.01, far below half the smallest step (0.5)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)).eval()
    x = torch.full((8, 64), 0.01)
    x[:, ::32] = 6.0
    return model, x


def test_gain_scan_deadzone_site_and_exact_unquantized_ratio(tiny):
    model, x = _deadzone_model()
    policy = {"version": 1, "quantize": [{"targets": ["0"], "format": "mxfp4", "tensors": ["input"]}],
              "instrument": {"targets": ["Linear"]}}
    rows = {r.site: r.metrics for r in gain_scan(model, policy, x, eps=1e-3).rows}
    assert rows["0"]["gain_q"] < 0.01 * rows["0"]["gain_fp"]  # small changes are swallowed
    assert rows["0"]["deadzone"] > 0.99  # the fp response is nonzero, the quantized one zero
    assert rows["1"]["gain_ratio"] == 1.0 and rows["1"]["gain_fp"] > 0
    qwen = {r.site: r.metrics for r in gain_scan(
        tiny("qwen2"), {**W4A16, "instrument": {"targets": ["Linear"]}}, ids()).rows}
    assert qwen["lm_head"]["gain_ratio"] == 1.0
    assert qwen[FIRST]["gain_ratio"] != 1.0 and 0.5 < qwen[FIRST]["gain_ratio"] < 2


def test_kurtosis_scan_equals_direct_moments(tiny):
    model = tiny("qwen2")
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "layers": "1", "format": "mxfp4"}],
              "instrument": {"targets": ["Linear"], "ignore": ["lm_head"]}}
    rows = {r.site: r.metrics for r in kurtosis_scan(model, policy, ids(4, 8), batch_size=2).rows}
    batches = calibration_batches(ids(4, 8), batch_size=2)
    fp = _outputs(model, list(rows), batches)
    quant = _outputs(qtransform.transform(model, policy), list(rows), batches)
    for name, metrics in rows.items():
        for key, y in (("kurtosis_fp", fp[name]), ("kurtosis_q", quant[name])):
            c = y - y.mean()
            assert metrics[key] == pytest.approx(float(c.pow(4).mean() / c.pow(2).mean() ** 2), rel=1e-9)
    assert rows[FIRST]["kurtosis_ratio"] == 1.0  # upstream of every quantized site
    assert rows["model.layers.1.mlp.down_proj"]["kurtosis_ratio"] != 1.0


def test_instability_scan_variance_across_stochastic_runs(tiny):
    model = tiny("qwen2")
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "layers": "1", "format": "mxfp4"}],
              "instrument": {"targets": ["Linear"], "ignore": ["lm_head"]}}
    x = ids(2, 6)
    rows = {r.site: r.metrics for r in instability_scan(model, policy, x, runs=4, seed=3).rows}
    assert rows[FIRST]["variance"] == 0.0 and rows[FIRST]["sqnr_db"] == math.inf
    down = "model.layers.1.mlp.down_proj"
    # the same stochastic policy, transformed again, draws the same numbers: recompute directly
    quant = qtransform.transform(model, stochastic_policy(resolve_policy(model, policy), 3))
    runs = torch.stack([_outputs(quant, [down], [x])[down] for _ in range(4)])
    assert rows[down]["variance"] == pytest.approx(float(runs.var(dim=0).mean()), rel=1e-9)
    assert rows[down]["rel_std"] > 0 and rows[down]["runs"] == 4


def test_calibration_files_and_batches(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("first sample\n\n second one \n")
    assert read_calibration(text) == ["first sample", "second one"]
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps([[1, 2, 3], [4, 5], [6, 7, 8]]))
    assert [b.tolist() for b in calibration_batches(read_calibration(ids_file), max_length=2)] == [
        [[1, 2], [4, 5], [6, 7]]]
    assert [b.shape for b in calibration_batches(read_calibration(ids_file))] == [(2, 3), (1, 2)]
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(UserError, match="list of strings or of token-id lists"):
        read_calibration(bad)
    with pytest.raises(UserError, match="needs the model's tokenizer"):
        calibration_batches(["some text"])
    assert len(builtin_calibration()) == 16


def test_cli_scan_with_calibration_file(tmp_path):
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(_ragged(4)))
    out = tmp_path / "scan"
    assert main(["scan", "builtin:qwen2", "--format", "mxfp4", "--calib", str(calib),
                 "--out", str(out), "--no-progress", "--threshold", "sqnr_db=10"]) == 0
    data = json.loads((out / "report.json").read_text())
    assert data["meta"]["kind"] == "activation_scan" and data["thresholds"]["sqnr_db"] == 10
    assert data["meta"]["calibration"]["file"] == str(calib)
    assert {"weight", "output"} == {r["point"] for r in data["rows"]}


def test_activation_plot_separates_points_and_titles_differ(tiny, tmp_path):
    """Weight, input and output points get their own marker, color and legend entry; every mark
    has one; the title says which scan it is."""
    from qtransform.scan import render
    from qtransform.scan.weights import scan_weights

    model = tiny("qwen2")
    w4a4 = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4",
                                        "tensors": ["weight", "input"]}]}
    report = scan_activations(model, w4a4, ids(2, 6))
    fig = render.report_figure(report)
    top, bottom = fig.axes
    assert "activation scan" in top.get_title("left") and "weight scan" not in top.get_title("left")
    for ax in (top, bottom):
        marks = [c for c in ax.collections] + [ln for ln in ax.lines]
        labels = [m.get_label() for m in marks]
        assert all(not lab.startswith("_") for lab in labels)  # no mark without a legend entry
        assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(labels)
        styles = {c.get_label(): (tuple(c.get_facecolor()[0]), c.get_paths()[0].vertices.tobytes())
                  for c in ax.collections}
        wanted = ("weight", "input (activation)", "output (local error)")
        assert set(wanted) <= set(styles)
        assert len({styles[k][0] for k in wanted}) == 3 and len({styles[k][1] for k in wanted}) == 3
        assert {"weight layer total", "input layer total", "output layer total"} <= set(labels)
        counts = {c.get_label(): len(c.get_offsets()) for c in ax.collections}
        assert counts["weight"] == sum(r.point == "weight" for r in report.rows if r.layer is not None)
    weights = render.report_figure(scan_weights(model, "mxfp4"))
    assert "weight scan" in weights.axes[0].get_title("left")
    assert weights.axes[0].get_title("left") != top.get_title("left")
    assert render.plot_png(report, tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


KV_HEAD = {"version": 1, "quantize": [{"targets": ["Attention"], "format": "fp8_e5m2",
                                       "tensors": ["key", "value"], "granularity": "head"}]}


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """FP8 E5M2 with one scale per head of [batch, heads, tokens, head_dim]."""
    return torch.cat([fake_quantize(x[:, h:h + 1], "fp8_e5m2", granularity="tensor")
                      for h in range(x.shape[1])], dim=1)


def _attention_tensors(model: nn.Module, batches: list[torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """Every layer's key and value at its attention call ([batch, kv heads, tokens, head_dim]),
    the batches concatenated on the batch axis, read by an attention function registered here
    that then attends with them quantized (`_per_head`), as the KV policy's model does."""
    import copy

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    seen: dict[tuple[int, str], list[torch.Tensor]] = {}

    def attention(module, query, key, value, attention_mask, **kwargs):
        seen.setdefault((module.layer_idx, "key"), []).append(key)
        seen.setdefault((module.layer_idx, "value"), []).append(value)
        return sdpa_attention_forward(module, query, _per_head(key), _per_head(value), attention_mask, **kwargs)

    AttentionInterface.register("scan-kv-reader", attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("scan-kv-reader", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    reader = copy.deepcopy(model)
    reader.config._attn_implementation_internal = "scan-kv-reader"
    with torch.no_grad():
        for batch in batches:
            reader(batch)
    return {k: torch.cat(v) for k, v in seen.items()}


def test_attention_rows_per_point_and_head_equal_direct_float64(tiny, tmp_path):
    """A KV policy (FP8 E5M2, one scale per head): one row per attention site and point with the
    SQNR, deadzone and saturation of the keys/values the attention call received, and each head's
    SQNR, all equal to float64 sums over `fake_quantize` of each head's slice; shown in the
    Markdown and kept by the JSON."""
    model = tiny("qwen2")
    batches = [ids(batch=4, seed=1)]
    report = scan_activations(model, KV_HEAD, batches[0], batch_size=4, token_stride=1)
    rows = {(r.site, r.point): r for r in report.rows if r.kind == "attention"}
    layers = model.config.num_hidden_layers
    assert sorted(rows) == [(f"model.layers.{i}.self_attn", p) for i in range(layers) for p in ("key", "value")]
    direct = _attention_tensors(model, batches)
    kv, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    for (site, point), row in rows.items():
        x = direct[int(site.split(".")[2]), point]
        q = _per_head(x)
        x64, e64 = x.double(), (x.double() - q.double())
        want = 10 * math.log10(float((x64**2).sum() / (e64**2).sum()))
        assert row.metrics["sqnr_db"] == pytest.approx(want, rel=1e-9)
        assert row.metrics["deadzone"] == pytest.approx(float(((q == 0) & (x != 0)).double().mean()), abs=1e-12)
        assert row.format == "fp8_e5m2" and row.shape == [x.numel() // dim, dim]
        per_head = [10 * math.log10(float((x64[:, h]**2).sum() / (e64[:, h]**2).sum())) for h in range(kv)]
        assert [h["metrics"]["sqnr_db"] for h in row.heads] == pytest.approx(per_head, rel=1e-9)
        assert 0.0 <= row.metrics["saturation"] < 0.01
    text = report.markdown()
    assert "## Attention heads" in text
    first = rows["model.layers.0.self_attn", "key"]
    assert (f"| model.layers.0.self_attn | key | {kv} |" in text
            and ", ".join(f"{h['metrics']['sqnr_db']:.2f}" for h in first.heads) in text)
    report.save(tmp_path)
    loaded = type(report).load(tmp_path)
    def sqnrs(rows) -> list[list[float]]:
        return [[h["metrics"]["sqnr_db"] for h in r.heads] for r in rows if r.kind == "attention"]

    assert sqnrs(loaded.rows) == sqnrs(report.rows)
