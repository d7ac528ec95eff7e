"""The pages of the other results: rollout/trainer parity, the ONNX export, and the demo's index
page that links every page of one run (docs/reports.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qtransform.core.program import insertion_log
from qtransform.core.sites import layer_index
from qtransform.passes import FakeQuantPass
from qtransform.report.page import Page
from qtransform.report.scan_pages import Links, grid, link_section, run_metadata
from qtransform.rl.parity_report import ATTRIBUTION_KEY, MEANING, ParityReport

if TYPE_CHECKING:
    from torch import nn


def _role(site: str) -> str:
    return site.rsplit(".", 1)[-1]


def parity_page(report: ParityReport, *, command: str | None = None, links: Links = ()) -> Page:
    """The page of `qtransform parity`: the mismatch metrics with their floor and gap, the gaps
    per token and per sequence, the attribution by layer and role, the largest gaps."""
    import plotly.graph_objects as go

    m = report.meta
    meta = {"model": m.get("model"), "engine": m.get("engine"), "policy": m.get("policy_path"),
            "sampler": m.get("sampler"), "seed": m.get("seed"), "phase": report.phase,
            "controller step": m.get("controller_step"),
            "qtransform_version": m.get("qtransform_version"), "created": m.get("date")}
    page = Page("Rollout/trainer parity", run_metadata({}, command) | {k: v for k, v in meta.items()
                                                                         if v is not None})
    agree = "n/a" if report.greedy_agreement is None else f"{report.greedy_agreement:.4f}"
    page.section("Summary", f"{report.tokens} completion tokens in {len(report.k1)} sequences; mean "
                 f"|Δ log-prob| {report.mean_abs_delta:.3e}, max {report.max_abs_delta:.3e}; greedy "
                 f"token agreement {agree}; {report.outside_support} sampled tokens outside the "
                 "trainer's processed distribution (left out of the metrics).")
    page.section("Mismatch (verl's rollout_corr metrics)", "floor: the original model against the "
                 "same engine; gap: value minus floor, what the transform adds.")
    page.table([{"metric": k, "value": v, **({"floor": report.floor[k], "gap": report.gap[k]}
                                              if report.floor and report.gap else {}),
                 "meaning": MEANING.get(k, "")} for k, v in report.metrics.items()],
               sortable=False, id="metrics")
    gaps = [math.log10(max(abs(d), 1e-12)) for seq in report.deltas for d in seq if math.isfinite(d)]
    fig = go.Figure(go.Histogram(x=gaps, nbinsx=40))
    fig.update_layout(title="log10 |Δ log-prob| per token (exact zeros at -12)", height=320,
                      xaxis_title="log10 |Δ|", yaxis_title="tokens")
    page.figure(fig)
    fig = go.Figure([go.Bar(x=list(range(len(report.k1))), y=report.k1, name="k1"),
                     go.Bar(x=list(range(len(report.k3))), y=report.k3, name="k3")])
    fig.update_layout(title="KL per sequence (k1, k3)", height=320, xaxis_title="sequence")
    page.figure(fig)
    if report.attribution:
        rows = report.attribution
        layers, roles, values = grid(rows, lambda r: layer_index(r["site"]), lambda r: _role(r["site"]),
                                     lambda rs: max(r["added"] for r in rs))
        page.heatmap(layers, roles, values, f"{ATTRIBUTION_KEY} each site adds alone, by layer and "
                     "role (higher: more mismatch)", ATTRIBUTION_KEY, reverse=True)
        page.section("Sites that add most", "Each site alone transformed (every other site off).")
        page.flags([(r["site"], f"rank {r['rank']}: adds {r['added']:+.3e} {ATTRIBUTION_KEY} to the "
                     "floor when it alone is transformed") for r in rows[:5] if r["added"] > 0])
        page.table([{"rank": r["rank"], "site": r["site"], "modules": ", ".join(r["modules"]),
                     f"added {ATTRIBUTION_KEY}": r["added"], "kl": r["kl"], "chi2_token": r["chi2_token"],
                     "log_ppl_abs_diff": r["log_ppl_abs_diff"]} for r in rows], id="sites")
    page.section("Largest gaps")
    page.table([{"sequence": t["sequence"], "position": t["position"], "token": t["token"],
                 "text": t.get("text") or "", "trainer": t["trainer"], "engine": t["engine"],
                 "Δ": t["delta"]} for t in report.largest], id="largest")
    link_section(page, links)
    return page


def export_summary(path: str | os.PathLike[str], model: nn.Module, fake_quant: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What `export_page` shows of an exported model: the file's graph inputs and outputs and
    the transformed model's insertion log."""
    import onnx

    log = [i.to_dict() for i in insertion_log(model)]
    graph = onnx.load(str(path), load_external_data=False).graph
    return {"out": str(path),
            "fake_quant_nodes": sum(1 for e in log if e["pass_name"] == FakeQuantPass.name),
            "inputs": [i.name for i in graph.input], "outputs": [o.name for o in graph.output],
            "fake_quant": fake_quant}, log


def export_page(summary: dict[str, Any], insertions: Sequence[dict[str, Any]], *,
                command: str | None = None, links: Links = ()) -> Page:
    """The page of `qtransform export`: what the ONNX file holds (inputs, outputs, taps, noise
    inputs) and every module the transform inserted, by layer and role."""
    page = Page(f"ONNX export: {summary['out']}", run_metadata({}, command) | {
        k: v for k, v in summary.items() if k not in ("inputs", "outputs")})
    taps = [o for o in summary["outputs"] if o.startswith("tap:")]
    noise = [i for i in summary["inputs"] if i.startswith("noise:")]
    page.section("Summary", f"{len(insertions)} inserted modules, {summary.get('fake_quant_nodes', 0)} "
                 f"fake-quant; graph inputs: {', '.join(summary['inputs'])}; {len(taps)} tap outputs, "
                 f"{len(noise)} noise inputs.")
    if insertions:
        layers, roles, values = grid(insertions, lambda e: layer_index(e["site"]),
                                     lambda e: _role(e["site"]), lambda es: float(len(es)))
        page.heatmap(layers, roles, values, "Inserted modules by layer and role", "modules")
    page.section("Inserted modules")
    page.table([{"site": e["site"], "point": e["point"], "pass": e["pass_name"], "tag": e["tag"],
                 "module": e["module_path"]} for e in insertions], id="sites")
    page.section("Graph outputs")
    page.table([{"output": o} for o in summary["outputs"]], id="outputs")
    link_section(page, links)
    return page


def index_page(title: str, metadata: dict[str, Any], pages: Sequence[tuple[str, str, str]],
               summary: str = "") -> Page:
    """A run's index: one link per page (text, relative href, what it shows)."""
    page = Page(title, metadata)
    if summary:
        page.section("Summary", summary)
    page.section("Pages of this run")
    page.table([{"page": text, "file": href, "shows": what} for text, href, what in pages],
               sortable=False, filterable=False, id="pages")
    for text, href, _ in pages:
        page.link(text, href)
    return page
