"""The pages of the scan results: weight and activation scans, format comparison, sensitivity and
the guide's policy. Each function turns one result object into a `Page` (docs/reports.md lists
what each shows); the CLI writes it beside the result's JSON.

Point kinds are never pooled: an activation scan gets one heatmap per measured point (weight,
input, output), since a weight SQNR and an output SQNR are different quantities.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from qtransform.report.histograms import site_histograms
from qtransform.report.page import Page
from qtransform.scan.compare import Comparison
from qtransform.scan.problems import expected_for
from qtransform.scan.recommend import recommend
from qtransform.scan.render import end_to_end_text, fos_table, plot_title
from qtransform.scan.report import ScanReport, SiteRow
from qtransform.scan.sensitivity_report import SensitivityReport, measure_label

if TYPE_CHECKING:
    from torch import nn

SPAN_DB = 6.0  # SQNR heatmaps: colors cover at least ±6 dB (one bit), so noise is not drawn red
Links = Sequence[tuple[str, str]]  # (text, relative href) of the run's other pages
T = TypeVar("T")  # what a heatmap's items are: report rows, insertion dicts
POINT_TITLE = {"weight": "weights", "input": "inputs (activations)", "output": "outputs (local error)"}


def command_line() -> str:
    """The command that is running, as a user would type it again."""
    return shlex.join(["qtransform", *sys.argv[1:]])


def run_metadata(meta: dict[str, Any], command: str | None = None) -> dict[str, Any]:
    """What a reader needs to reproduce a result: model, format/policy, versions, seed, command."""
    options = dict(meta.get("options") or {})
    keys = ("kind", "source", "format", "policy", "scale_rule", "flagging", "qtransform_version",
            "torch_version", "created")
    out = {k: meta[k] for k in keys if meta.get(k) not in (None, "", {})}
    if options:
        out["options"] = options
    seed = meta.get("seed", options.get("seed"))
    out["seed"] = "none (deterministic rounding)" if seed is None else seed
    if command:
        out["command"] = command
    return out


def layer_label(layer: int | None) -> str:
    return "other" if layer is None else str(layer)


def grid(items: Sequence[T], layer: Callable[[T], int | None], role: Callable[[T], str],
         value: Callable[[list[T]], float | None]) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(layers, roles, values[role][layer]) of items placed by the `layer`/`role` getters, the
    value of a cell from the items that fall into it (None where none does)."""
    layers = sorted({layer(i) for i in items}, key=lambda x: (x is None, x or 0))
    roles = list(dict.fromkeys(role(i) for i in items))
    cells: dict[tuple[Any, str], list[Any]] = {}
    for i in items:
        cells.setdefault((layer(i), role(i)), []).append(i)
    values = [[value(cells[(lay, r)]) if (lay, r) in cells else None for lay in layers] for r in roles]
    return [layer_label(x) for x in layers], roles, values


def link_to(target: str | os.PathLike[str], page: str | os.PathLike[str], text: str) -> list[tuple[str, str]]:
    """[(text, target relative to the page's folder)] when `target` exists, else []."""
    t = Path(target)
    if not t.is_file():
        return []
    return [(text, Path(os.path.relpath(t.resolve(), Path(page).resolve().parent)).as_posix())]


def link_section(page: Page, links: Links) -> None:
    """The run's other pages, as links at the end of a page."""
    if links:
        page.section("Other pages of this run")
        for text, href in links:
            page.link(text, href)


# -- scans ---------------------------------------------------------------------------------------
def _site_table(report: ScanReport) -> tuple[list[dict[str, Any]], list[bool]]:
    rows, flagged = [], []
    for r in report.rows:
        why = report.row_problems(r)
        expected = expected_for(r)
        exps = r.block_exponents or {}
        m = r.metrics
        rows.append({
            "site": r.site, "point": r.point, "layer": layer_label(r.layer), "role": r.role,
            "shape": "x".join(map(str, r.shape)), "format": r.format, "SQNR dB": m["sqnr_db"],
            "expected dB": expected["sqnr_db"] if expected else None,
            "rel_rmse %": 100 * m["rel_rmse"], "cosine": m["cosine"],
            "deadzone %": 100 * m["deadzone"], "saturation %": 100 * m["saturation"],
            "block exp": "" if exps.get("min") is None else f"{exps['min']}..{exps['max']}",
            "SQNR dB per head": _heads_text(r),
            "problems": "; ".join(why)})
        flagged.append(bool(why))
    return rows, flagged


def _heads_text(row: SiteRow) -> str:
    """An attention row's SQNR head by head ("" for other rows)."""
    return ", ".join(f"{(h.get('metrics') or {}).get('sqnr_db', math.nan):.2f}" for h in row.heads or ())


def _detail_figure(row: SiteRow, hists: dict[str, Any] | None) -> dict[str, Any] | None:
    """One site's detail: its weight and error histograms (when computed) and the spread of its
    MX block exponents (when the format has them), side by side in plotly.js's own grid (a
    figure dict: building plotly.py objects for hundreds of sites would cost seconds)."""
    panels = []
    if hists:
        for title, h, color in (("weight value", hists["weight"], "#4c72b0"),
                                ("quantization error (q - w)", hists["error"], "#dd8452")):
            e = h["edges"]
            panels.append((title, "count", color,
                           [_short((a + b) / 2) for a, b in zip(e, e[1:], strict=False)], h["counts"],
                           [_short(b - a) for a, b in zip(e, e[1:], strict=False)]))
    counts = (row.block_exponents or {}).get("counts") or {}
    if counts:
        exps = sorted(counts, key=int)
        panels.append(("block exponent (power of two)", "blocks", "#7a5195", [int(e) for e in exps],
                       [counts[e] for e in exps], None))
    if not panels:
        return None
    data, layout = [], {}
    for i, (xtitle, ytitle, color, x, y, width) in enumerate(panels, 1):
        axis = "" if i == 1 else str(i)
        data.append({"type": "bar", "x": x, "y": y, "marker": {"color": color}, "showlegend": False,
                     "xaxis": f"x{axis}", "yaxis": f"y{axis}", "name": xtitle,
                     **({"width": width} if width else {})})
        layout[f"xaxis{axis}"] = {"title": {"text": xtitle}}
        layout[f"yaxis{axis}"] = {"title": {"text": ytitle}}
    layout.update(title={"text": f"{row.label}: SQNR {row.metrics['sqnr_db']:.2f} dB"}, height=330,
                  grid={"rows": 1, "columns": len(panels), "pattern": "independent"},
                  margin={"t": 50, "b": 50})
    return {"data": data, "layout": layout}


def scan_page(report: ScanReport, *, histograms: dict[str, dict[str, Any]] | None = None,
              command: str | None = None, links: Links = ()) -> Page:
    """The page of a weight or activation scan (`histograms`: `report.histograms.site_histograms`)."""
    page = Page(plot_title(report), run_metadata({**report.meta, "flagging": report.flagging}, command))
    problems = report.problems()
    rec = recommend(report)
    summary = (f"{len(report.rows)} measured (site, point) rows in {len(report.layers())} layers; "
               f"{len(problems)} flagged. Flagging: {report.flagging} "
               + ("(a site is flagged when it is worse than what the format does to Gaussian data of "
                  "its shape, by a margin, or an outlier among the model's sites; docs/metrics.md)."
                  if report.flagging == "expected" else "(fixed thresholds: "
                  + ", ".join(f"{k} {v:g}" for k, v in report.thresholds.items()) + ")."))
    page.section("Summary", summary)
    end = end_to_end_text(report)
    if end:
        page.text("End to end: " + end)
    page.text("Recommendation: " + rec.text)
    points = list(dict.fromkeys(r.point for r in report.rows))
    for point in points:
        mine = [r for r in report.rows if r.point == point]
        layers, roles, values = grid(mine, lambda r: r.layer, lambda r: r.role,
                                     lambda rs: report.aggregate(rs)["sqnr_db"])
        expected = [e["sqnr_db"] for e in map(expected_for, mine) if e is not None]
        centered = f", centered on the format's expected {expected[0]:.1f} dB" if expected else ""
        page.heatmap(layers, roles, values, f"SQNR of the {POINT_TITLE.get(point, point)} by layer "
                     f"and role (dB, higher is better{centered})", "dB",
                     center=sorted(expected)[len(expected) // 2] if expected else None, span=SPAN_DB)
    page.section("Flagged sites", "Each flagged row with the reasons in words.")
    page.flags([(r.label, "; ".join(why)) for r, why in problems])
    head, fos_rows = fos_table(report)
    if head:
        page.section("Four over six beside NVFP4", "Each plain NVFP4 weight quantized again keeping, "
                     "per block, the max/4 scale where its error is smaller, with the share of blocks "
                     "that kept it; no storage bit, only quantization time. \"cleared\": the flagged "
                     "sites the recommendation's four over six clears.")
        page.table([dict(zip(head, cells, strict=True)) for cells in fos_rows], id="four_over_six",
                   flagged=[cells[-2] == "yes" for cells in fos_rows])
    page.section("Sites", "One row per measured (site, point); click a column to sort, type to "
                 "filter. Flagged rows are red; \"expected dB\" is what the format does to Gaussian "
                 "data of the same block structure.")
    rows, flagged = _site_table(report)
    page.table(rows, id="sites", flagged=flagged)
    details = {}
    for row in report.rows:
        fig = _detail_figure(row, (histograms or {}).get(row.site) if row.point == "weight" else None)
        if fig is not None:
            details[row.label] = fig
    if details:
        page.section("Per-site detail", "Weight values and the quantization error (q - w) of the "
                     "chosen site as histograms (computed for models up to 50M scanned weights), and "
                     "how many blocks share each power-of-two block exponent (MX formats).")
        page.detail("site", details)
    link_section(page, links)
    return page


def write_scan_page(report: ScanReport, path: str | os.PathLike[str], *,
                    source: nn.Module | str | os.PathLike[str] | None = None,
                    command: str | None = None, links: Links = ()) -> Path:
    """report.html: `scan_page`, with weight and error histograms when `source` (the scanned
    module or checkpoint) is given and small enough."""
    hists = site_histograms(source, report) if source is not None else None
    return scan_page(report, histograms=hists, command=command, links=links).write(path)


# -- comparison ----------------------------------------------------------------------------------
def compare_page(comparison: Comparison, *, command: str | None = None, links: Links = ()) -> Page:
    """The page of `qtransform compare`: totals, winners, per-layer SQNR of each format."""
    import plotly.graph_objects as go

    first = next(iter(comparison.reports.values()))
    page = Page(f"Format comparison: {', '.join(comparison.formats)} on {first.meta.get('source')}",
                run_metadata({**first.meta, "format": ", ".join(comparison.formats)}, command))
    page.section("Whole model", "Every compared metric over all weights together; \"better\" is "
                 "the winner of that metric.")
    totals = [{"metric": m, **{f: comparison.totals[f][m] for f in comparison.formats},
               "better": comparison.winners[m]} for m in comparison.winners]
    if any("max4_share" in t for t in comparison.totals.values()):  # four-over-six columns
        totals.append({"metric": "max/4 blocks %", **{f: 100 * t["max4_share"] if "max4_share" in t
                                                      else None for f, t in comparison.totals.items()},
                       "better": ""})
    page.table(totals, sortable=False, filterable=False, id="totals")
    for note in comparison.notes:
        page.text(note)
    layers = comparison.per_layer()
    overall = comparison.winners["sqnr_db"]
    fig = go.Figure([go.Scatter(x=[layer_label(e["layer"]) for e in layers],
                                y=[_finite(e["sqnr_db"][f]) for e in layers], mode="lines+markers",
                                name=f) for f in comparison.formats])
    fig.update_layout(title="SQNR of each layer's weights by format (dB)", xaxis_title="layer",
                      yaxis_title="dB", height=380, xaxis={"type": "category"})
    page.figure(fig)
    for fmt, rep in comparison.reports.items():
        lay, roles, values = grid(rep.rows, lambda r: r.layer, lambda r: r.role,
                                  lambda rs, rep=rep: rep.aggregate(rs)["sqnr_db"])
        page.heatmap(lay, roles, values, f"{fmt}: weight SQNR by layer and role (dB)", "dB",
                     span=SPAN_DB)
    page.section("Where the formats differ", f"Layers where another format than {overall} (the "
                 "whole model's winner) has the higher SQNR.")
    page.flags([(f"layer {layer_label(e['layer'])}", f"{e['winner']} is better here "
                 f"({_db_list(e['sqnr_db'])})")
                for e in layers if e["winner"] != overall])
    page.section("Per layer")
    page.table([{"layer": layer_label(e["layer"]), "sites": e["sites"],
                 **{f"{f} dB": e["sqnr_db"][f] for f in comparison.formats}, "better": e["winner"]}
                for e in layers], id="layers", flagged=[e["winner"] != overall for e in layers])
    page.section("Sites", "Each site's weight SQNR under every format.")
    by_site = {f: {r.site: r for r in rep.rows} for f, rep in comparison.reports.items()}
    page.table([{"site": r.site, "layer": layer_label(r.layer), "role": r.role,
                 **{f"{f} dB": by_site[f][r.site].metrics["sqnr_db"] for f in comparison.formats
                    if r.site in by_site[f]}} for r in first.rows], id="sites")
    link_section(page, links)
    return page


# -- sensitivity ---------------------------------------------------------------------------------
def sensitivity_page(report: SensitivityReport, *, top: int = 10, command: str | None = None,
                     links: Links = ()) -> Page:
    """The page of `qtransform sensitivity`: the ranking, by layer and role and as a table."""
    import plotly.graph_objects as go

    m = report.meta
    unit = measure_label(report.measure)
    page = Page(f"Sensitivity: {m.get('format')} on {m.get('source')}", run_metadata(m, command))
    page.section("Summary", f"{len(report.rows)} sites, each quantized alone; measure: {unit} of "
                 f"the {m.get('output')} ({m.get('method')}). Rank 1 is the most sensitive site: "
                 "the first to keep in high precision.")
    ranked = report.ranked()
    layers, roles, values = grid(report.rows, lambda r: r.layer, lambda r: r.role,
                                 lambda rs: _log10(max(r.score() for r in rs)))
    page.heatmap(layers, roles, values, f"log10 {unit} by layer and role (higher: more sensitive)",
                 "log10", reverse=True)
    best = ranked[:top]
    fig = go.Figure(go.Bar(x=[r.score() for r in best][::-1], y=[r.site for r in best][::-1],
                           orientation="h", hovertemplate="%{y}: %{x:.4g}<extra></extra>"))
    fig.update_layout(title=f"The {len(best)} most sensitive sites", xaxis_title=unit,
                      xaxis_type="log", height=120 + 24 * len(best), margin={"l": 260})
    page.figure(fig)
    page.section("Most sensitive sites")
    page.flags([(r.site, f"rank {r.rank}: quantizing it alone costs {r.score():.4g} ({unit})")
                for r in best])
    page.section("All sites")
    page.table([{"rank": r.rank, "site": r.site, "layer": layer_label(r.layer), "role": r.role,
                 "params": r.params, "format": r.format, "points": "+".join(r.points),
                 "exact": r.exact, "estimate": r.estimate,
                 "estimate rank": r.estimate_rank} for r in ranked], id="sites")
    link_section(page, links)
    return page


# -- guide ---------------------------------------------------------------------------------------
def guide_page(report: ScanReport, policy: dict[str, Any], advice: str, *,
               command: str | None = None, links: Links = ()) -> Page:
    """The page of `qtransform guide`: the policy it wrote, why, and the scan it read."""
    page = Page(f"Guide: policy from the {report.meta.get('format')} scan of {report.meta.get('source')}",
                run_metadata({**report.meta, "flagging": report.flagging}, command))
    page.section("Why", advice)
    page.section("The policy written", "As saved beside this page (JSON).")
    page.code(json.dumps(policy, indent=2))
    weights = [r for r in report.rows if r.point == "weight"] or report.rows
    layers, roles, values = grid(weights, lambda r: r.layer, lambda r: r.role,
                                 lambda rs: report.aggregate(rs)["sqnr_db"])
    page.heatmap(layers, roles, values, "SQNR of the scanned sites by layer and role (dB)", "dB",
                 span=SPAN_DB)
    page.section("Flagged sites of the scan")
    page.flags([(r.label, "; ".join(why)) for r, why in report.problems()])
    link_section(page, links)
    return page


def _short(v: float) -> float:
    """4 significant digits: what a histogram axis needs, a third of the page's bytes saved."""
    return float(f"{v:.4g}")


def _db_list(sqnr: dict[str, float]) -> str:
    return ", ".join(f"{f} {v:.2f} dB" for f, v in sqnr.items())


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _log10(v: float) -> float | None:
    return math.log10(v) if math.isfinite(v) and v > 0 else None
