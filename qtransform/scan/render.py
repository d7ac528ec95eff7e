"""Renderers of a `ScanReport`: JSON with the recommendation, CSV, Markdown and a PNG plot.

Presentation lives here, not in the report: the report is data and problem checks, the
recommendation comes from `recommend`, and each renderer combines the two for one medium. The
report does not import this module: this module registers `save_report` and `to_markdown` as
the report's renderer when it loads (`report.register_renderer`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.scan import fos_remedy
from qtransform.scan.grid import grid_line
from qtransform.scan.kv_remedy import clears
from qtransform.scan.recommend import recommend
from qtransform.scan.remedy import healed_sites
from qtransform.scan.report import Renderer, ScanReport, SiteRow, register_renderer
from qtransform.schemas.selectors import format_layers

FILES = ("report.json", "report.csv", "report.md", "report.png")
_PERCENT = ("rel_rmse", "deadzone", "saturation", "mean_rel_error")
_CSV_METRICS = (
    "sqnr_db", "mse", "rmse", "rel_rmse", "cosine", "max_abs_error", "deadzone", "saturation",
    "mean_rel_error", "kurtosis_orig", "kurtosis_quant", "n", "nonzero", "deadzone_count",
    "saturated_count", "nan_orig", "nan_quant", "nonfinite",
)


def report_json(report: ScanReport, indent: int | None = 2) -> str:
    """report.json: the report's data plus the recommender's verdict on it."""
    data = {**report.to_dict(), "recommendation": encode_floats(recommend(report).to_dict())}
    return json.dumps(data, indent=indent, allow_nan=False)


NO_TOKENS = "no tokens"  # an expert that no calibration token was routed to: nothing measured


def to_csv(report: ScanReport) -> str:
    """One line per row; metrics as plain numbers (inf/nan as Python spells them). A fused
    experts row is followed by one line per expert (`expert`, `tokens`; empty metrics and the
    reason "no tokens" for an expert that no calibration token reached)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["site", "point", "expert", "tokens", "layer", "role", "kind", "shape", "format",
                     *_CSV_METRICS, "block_exp_min", "block_exp_max", "problematic", "problems"])
    for row in report.rows:
        why = report.row_problems(row)
        exps = row.block_exponents or {}
        ident = ["" if row.layer is None else row.layer, row.role, row.kind]
        shape = "x".join(map(str, row.shape))
        writer.writerow([
            row.site, row.point, "", "", *ident, shape, row.format,
            *(row.metrics[k] for k in _CSV_METRICS),
            exps.get("min", ""), exps.get("max", ""), int(bool(why)), "; ".join(why),
        ])
        for entry in row.experts or ():
            m = entry.get("metrics")
            writer.writerow([
                row.site, row.point, entry["expert"], entry.get("tokens", ""), *ident,
                "x".join(map(str, row.shape[1:])) if row.point == "weight" else "", row.format,
                *(m[k] if m else "" for k in _CSV_METRICS), "", "", "", "" if m else NO_TOKENS,
            ])
    return buf.getvalue()


def experts_markdown(report: ScanReport) -> list[str]:
    """The experts section: per layer and expert, its errors merged over the layer's experts
    sites and its tokens; then every experts site expert by expert. [] without experts rows."""
    summary = report.expert_summary()
    if not summary:
        return []
    cols = ("sqnr_db", "rel_rmse", "deadzone", "saturation")
    head = ["SQNR dB", "rel_rmse", "deadzone", "saturation"]

    def cells(metrics: dict[str, float] | None) -> list[str]:
        if metrics is None:
            return [NO_TOKENS] * len(cols)
        return [format_metric(k, metrics[k]) for k in cols]

    lines = ["", "## Experts", "",
             "Per layer and expert, merged over the layer's experts sites (gate_up and down); "
             f"\"{NO_TOKENS}\": no calibration token was routed to the expert.", ""]
    lines += _md_table(
        ["layer", "point", "expert", "tokens", "sites", *head],
        [["" if e["layer"] is None else e["layer"], e["point"], e["expert"],
          "" if e["tokens"] is None else e["tokens"], e["sites"], *cells(e["metrics"])]
         for e in summary])
    lines += ["", "### Experts by site", ""]
    lines += _md_table(
        ["site", "expert", "tokens", *head],
        [[row.label, e["expert"], e.get("tokens", ""), *cells(e.get("metrics"))]
         for row in report.rows for e in row.experts or ()])
    return lines


def to_markdown(report: ScanReport) -> str:
    """A human-readable report: summary, recommendation, per-layer and per-site tables."""
    rec = recommend(report)
    opts = ", ".join(f"{k}={v}" for k, v in report.meta.get("options", {}).items())
    total = report.aggregate() if report.rows else {}
    lines = [
        f"# Scan report: {report.meta.get('format')} on {report.meta.get('source')}", "",
        f"- kind: {report.meta.get('kind')}; options: {opts or 'per site'}",
        f"- qtransform {report.meta.get('qtransform_version')}, created {report.meta.get('created')}",
        "- thresholds: " + ", ".join(f"{k} {v:g}" for k, v in report.thresholds.items()),
        f"- {len(report.rows)} sites in {len(report.layers())} layers; "
        f"{len(report.problems())} problematic sites; problematic layers: "
        f"{_ranges(report.problematic_layers()) or 'none'}",
    ]
    if total:
        for point in report.points():
            mine = report.aggregate([r for r in report.rows if r.point == point])
            lines.append(f"- whole model, {point} points: " + ", ".join(
                f"{k} {format_metric(k, mine[k])}" for k in ("sqnr_db", "rel_rmse", "cosine", "deadzone", "saturation")))
    end = end_to_end_text(report)
    if end:
        lines.append(f"- end to end: {end}")
    if grid := grid_line(report.meta.get("grids") or {}):
        lines.append(f"- {grid}")
    lines += ["", "## Recommendation", "", rec.text, "", "```json",
              json.dumps(rec.policy, indent=2), "```", "", "## Layers", ""]
    lines += ["One row per layer and point kind (weight, input, output): their errors are never "
              "pooled.", ""]
    lines += _md_table(
        ["layer", "point", "sites", "SQNR dB", "worst site", "worst SQNR dB", "rel_rmse", "deadzone",
         "saturation", "problem sites"],
        [[e["layer"], e["point"], e["sites"], format_metric("sqnr_db", e["sqnr_db"]), e["worst_site"],
          format_metric("sqnr_db", e["worst_sqnr_db"]), format_metric("rel_rmse", e["rel_rmse"]),
          format_metric("deadzone", e["deadzone"]), format_metric("saturation", e["saturation"]), e["problem_sites"]]
         for e in report.layer_summary()],
    )
    lines += ["", "## Sites", ""]
    lines += _md_table(
        ["site", "point", "layer", "role", "shape", "SQNR dB", "rel_rmse", "cosine", "max err",
         "deadzone", "saturation", "mean rel err*", "problems"],
        [[r.site, r.point, "" if r.layer is None else r.layer, r.role, "x".join(map(str, r.shape)),
          *(format_metric(k, r.metrics[k]) for k in ("sqnr_db", "rel_rmse", "cosine", "max_abs_error",
                                              "deadzone", "saturation", "mean_rel_error")),
          "; ".join(report.row_problems(r))] for r in report.rows],
    )
    lines += experts_markdown(report)
    lines += heads_markdown(report)
    lines += fos_markdown(report)
    lines += remedy_markdown(report)
    lines += kv_remedy_markdown(report)
    lines += ["", "*mean relative error is dominated by small values that quantize to zero; "
              "it is reported for comparison with older SRDD scans only (docs/metrics.md)."]
    return "\n".join(lines) + "\n"

def heads_markdown(report: ScanReport) -> list[str]:
    """The attention heads section: each attention row's SQNR head by head (the worst head
    first named), so one head a KV format ruins shows beside the site's pooled figure. [] without
    attention rows."""
    rows = [r for r in report.rows if r.heads]
    if not rows:
        return []

    def sqnr(entry: dict) -> float:
        return (entry.get("metrics") or {}).get("sqnr_db", math.nan)

    table = []
    for r in rows:
        values = [sqnr(h) for h in r.heads or ()]
        worst = min(range(len(values)), key=lambda h: math.inf if math.isnan(values[h]) else values[h])
        table.append([r.site, r.point, len(values), format_metric("sqnr_db", r.metrics["sqnr_db"]),
                      f"{worst} ({format_metric('sqnr_db', values[worst])})",
                      ", ".join(format_metric("sqnr_db", v) for v in values)])
    return ["", "## Attention heads", "",
            "Per attention site and point, the SQNR (dB) of each head (key/value: the key/value "
            "heads) beside the site's.", "",
            *_md_table(["site", "point", "heads", "SQNR dB", "worst head", "SQNR dB per head"], table)]


def fos_table(report: ScanReport) -> tuple[list[str], list[list[Any]]]:
    """Four over six beside plain NVFP4, per weight row that measured it (scan/fos_remedy.py):
    header and rows (SQNR as scanned; per mode its SQNR, gain and share of max/4 blocks; flagged;
    whether the recommended mode clears it). ([], []) without."""
    keys = fos_remedy.labels(report)
    if not keys:
        return [], []
    choice = fos_remedy.choose(report)
    cleared = {s for s, _, _, _ in choice.cleared} if choice is not None else set()
    head = ["site", "SQNR dB"]
    for key in keys:
        head += [f"{key} dB", f"{key} gain dB", f"{key} max/4 blocks"]
    head += ["flagged", "cleared"]
    rows = []
    for r in report.rows:
        if not any(k in (r.remedies or {}) for k in keys):
            continue
        cells: list[Any] = [r.site, format_metric("sqnr_db", r.metrics["sqnr_db"])]
        for key in keys:
            found = (r.remedies or {}).get(key)
            cells += ["", "", ""] if found is None else [
                format_metric("sqnr_db", found["metrics"]["sqnr_db"]),
                f"{found['metrics']['sqnr_db'] - r.metrics['sqnr_db']:+.2f}",
                f"{100 * found['max4_share']:.1f} %"]
        cells += ["yes" if report.row_problems(r) else "", "yes" if r.site in cleared else ""]
        rows.append(cells)
    return head, rows


def fos_markdown(report: ScanReport) -> list[str]:
    """report.md's four-over-six section ([] when the scan measured none)."""
    head, rows = fos_table(report)
    if not head:
        return []
    return ["", "## Four over six beside NVFP4", "",
            "Each plain NVFP4 weight quantized again keeping, per block of 16, the max/4 scale "
            "where its error is smaller (arXiv 2512.02010), and the share of blocks that kept it. "
            "It costs no storage bit (the checkpoint is ordinary NVFP4), only quantization time; "
            "`guide` gives it to the rules of the flagged sites it clears.", "",
            *_md_table(head, rows)]


def remedy_markdown(report: ScanReport) -> list[str]:
    """The rotation a weight scan measured (scan/remedy.py), beside each site's error: its SQNR
    with the rotation, the gain, and whether it heals a flagged site (empty without one)."""
    label, healed, _ = healed_sites(report)
    if label is None:
        return []
    rows = [r for r in report.rows if r.remedies and label in r.remedies]
    return ["", f"## Rotation remedy: {label}", "",
            "The format's error on each weight rotated along its reduction axis (W·R: the same "
            "SQNR as on W under the rotation). It costs an online transform of the site's "
            "inputs, no bit; `guide` rotates the flagged sites it heals.", "",
            *_md_table(["site", "SQNR dB", f"with {label}", "gain dB", "flagged", "healed"],
                       [[r.site, format_metric("sqnr_db", r.metrics["sqnr_db"]),
                         format_metric("sqnr_db", r.remedies[label]["metrics"]["sqnr_db"]),
                         f"{r.remedies[label]['metrics']['sqnr_db'] - r.metrics['sqnr_db']:+.2f}",
                         "yes" if report.row_problems(r) else "", "yes" if r.site in healed else ""]
                        for r in rows])]


def kv_remedy_markdown(report: ScanReport) -> list[str]:
    """The finer KV scales an activation scan measured on each key/value row (scan/kv_remedy.py):
    SQNR and deadzone per rung, and whether the rung clears a flagged row. [] without them."""
    rows = [r for r in report.rows if r.kind == "attention" and r.remedies]
    if not rows:
        return []
    labels = sorted({k for r in rows for k in r.remedies or {}},
                    key=lambda k: next(r.remedies[k]["rank"] for r in rows if k in (r.remedies or {})))

    def cell(row: SiteRow, label: str) -> str:
        if label not in (row.remedies or {}):
            return ""
        m = row.remedies[label]["metrics"]
        verdict = (" (clears)" if clears(report, row, label) else " (flagged)") if report.row_problems(row) else ""
        return f"{format_metric('sqnr_db', m['sqnr_db'])} dB, {format_metric('deadzone', m['deadzone'])}{verdict}"

    return ["", "## KV-cache alternatives", "",
            "Each key/value row measured again with finer scales, cheapest first (SQNR, deadzone); "
            "`guide` rewrites the KV rule to the cheapest that clears its flagged rows.", "",
            *_md_table(["site", "point", "as scanned", *labels],
                       [[r.site, r.point, f"{format_metric('sqnr_db', r.metrics['sqnr_db'])} dB, "
                         f"{format_metric('deadzone', r.metrics['deadzone'])}", *(cell(r, k) for k in labels)]
                        for r in rows])]


def end_to_end_text(report: ScanReport) -> str:
    """The activation scan's whole-model effect in one line: loss and perplexity of causal LMs
    (fp -> quantized), the final output's SQNR and mean token cosine ("" for weight scans)."""
    end = report.meta.get("end_to_end") or {}
    if not end:
        return ""
    parts = []
    if "loss_fp" in end:
        parts.append(f"loss {end['loss_fp']:.4f} -> {end['loss_quant']:.4f}, perplexity "
                     f"{end['perplexity_fp']:.3f} -> {end['perplexity_quant']:.3f}")
    parts.append(f"{end.get('output', 'output')} SQNR {format_metric('sqnr_db', end['sqnr_db'])} dB, "
                 f"mean token cosine {format_metric('cosine', end['mean_token_cosine'])}")
    return "; ".join(parts)


POINT_STYLE = {  # how each measured point is drawn: marker, color, legend label
    "weight": ("o", "tab:blue", "weight"),
    "input": ("^", "tab:green", "input (activation)"),
    "output": ("s", "tab:purple", "output (local error)"),
}
_OTHER_STYLE = ("D", "tab:gray", "{point}")


def plot_title(report: ScanReport) -> str:
    """What the plot shows, in its title: the scan's kind decides it (a weight scan and an
    activation scan of the same model must not look alike)."""
    kind = str(report.meta.get("kind", "weight_scan"))
    what = {"weight_scan": "weight scan", "activation_scan": "activation scan: weights, inputs, "
            "local output error"}.get(kind, kind.replace("_", " "))
    return f"{report.meta.get('format')} {what} of {Path(str(report.meta.get('source'))).name}"


def report_figure(report: ScanReport) -> Any:
    """The report's plot as a matplotlib Figure (Agg, pyplot untouched): per-site SQNR and
    deadzone by layer index, one marker and color per measured point (weight, input, output),
    problematic sites crossed in red, layer totals per point as lines, and the limits the flags
    actually use (`flag_rule_lines`); weight scans add a layer × role heatmap of SQNR."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # loaded only to draw (0.5 s)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    grid = role_grid(report)
    fig = Figure(figsize=(13, 9.5 if grid else 6.5), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg without touching pyplot's global backend
    if grid:
        top, bottom, heat = fig.subplots(3, 1, height_ratios=[3, 2, 2.2])
        bottom.sharex(top)
    else:
        top, bottom = fig.subplots(2, 1, sharex=True)
    layered = [r for r in report.rows if r.layer is not None]
    rows = layered or report.rows
    x_of = {id(r): (r.layer if layered else i) for i, r in enumerate(rows)}
    points = list(dict.fromkeys(r.point for r in rows))
    several = len(points) > 1
    bad = [r for r in rows if report.row_problems(r)]
    for ax, key, scale, unit in ((top, "sqnr_db", 1.0, "SQNR (dB)"), (bottom, "deadzone", 100.0, "deadzone (%)")):
        for point in points:
            marker, color, label = POINT_STYLE.get(point, _OTHER_STYLE)
            mine = [r for r in rows if r.point == point]
            ax.scatter([x_of[id(r)] for r in mine], [_finite(r.metrics[key]) * scale for r in mine],
                       s=14, alpha=0.6, marker=marker, color=color,
                       label=label.format(point=point) if several else "site")
            if layered:
                totals = [(layer, report.aggregate([r for r in mine if r.layer == layer])[key])
                          for layer in sorted({r.layer for r in mine})]
                ax.plot([t[0] for t in totals], [_finite(t[1]) * scale for t in totals], color=color
                        if several else "black", linewidth=1.2,
                        label=f"{point} layer total" if several else "layer total")
        if bad:
            ax.scatter([x_of[id(r)] for r in bad], [_finite(r.metrics[key]) * scale for r in bad],
                       s=40, marker="x", color="tab:red", label="problematic")
        for line in flag_rule_lines(report, key, rows):
            y = line["value"] * scale
            if line["rows"] is None:
                ax.axhline(y, color=line["color"], linestyle="--", linewidth=1, label=line["label"])
            else:
                ax.scatter([x_of[id(r)] for r in line["rows"]], [v * scale for v in line["values"]],
                           marker="_", s=120, color=line["color"], label=line["label"])
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)  # beside: no mark hidden
    bottom.set_xlabel("layer index" if layered else "site")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    skipped = len(report.rows) - len(rows)
    top.set_title(plot_title(report) + (f" ({skipped} site(s) outside layers not shown)" if skipped else ""),
                  loc="left", fontsize=10)
    if grid:
        layers, roles, values = grid
        image = heat.imshow(values, aspect="auto", cmap="RdYlGn", interpolation="nearest")
        heat.set_xticks(range(len(layers)), [str(k) for k in layers])
        heat.set_yticks(range(len(roles)), roles)
        heat.set_xlabel("layer index")
        heat.set_title("weight SQNR (dB) by layer and role (red: worst)", fontsize=9)
        fig.colorbar(image, ax=heat, label="SQNR (dB)")
    return fig


def role_grid(report: ScanReport) -> tuple[list[int], list[str], list[list[float]]] | None:
    """(layers, roles, SQNR[role][layer]) of the weight rows (NaN: no such site), where a layer ×
    role grid fits: a weight scan with layers and at least two roles; else None."""
    if report.meta.get("kind", "weight_scan") != "weight_scan":
        return None
    cells = {(r.layer, r.role): r.metrics["sqnr_db"] for r in report.rows
             if r.point == "weight" and r.layer is not None and not r.experts}
    roles = list(dict.fromkeys(role for _, role in cells))
    if len(roles) < 2:
        return None
    layers = sorted({layer for layer, _ in cells})
    return layers, roles, [[_finite(cells.get((layer, role), math.nan)) for layer in layers] for role in roles]


def flag_rule_lines(report: ScanReport, metric: str, rows: list[Any]) -> list[dict[str, Any]]:
    """The limits the flags use for `metric` (`ScanReport.flag_limit`), one entry per point kind:
    a horizontal line (`rows` None) when every row of the point shares its limit, else one mark
    per row (`rows`, `values`). Labels state the rule in words."""
    check = {"sqnr_db": ("SQNR", "dB", 1.0), "deadzone": ("deadzone", "%", 100.0)}[metric]
    if report.flagging == "absolute":
        value = report.flag_limit(rows[0], metric) if rows else report.thresholds.get(metric)
        sign = "<" if metric == "sqnr_db" else ">"
        return [{"value": value, "rows": None, "color": "red",
                 "label": f"flag rule (absolute): {check[0]} {sign} {value * check[2]:g} {check[1]}"}]
    out = []
    for point in dict.fromkeys(r.point for r in rows):
        mine = [(r, report.flag_limit(r, metric)) for r in rows if r.point == point]
        mine = [(r, v) for r, v in mine if v is not None]
        color = POINT_STYLE.get(point, _OTHER_STYLE)[1]
        if not mine:  # a legend entry that says why no line is drawn
            out.append({"value": math.nan, "rows": [], "values": [], "color": color,
                        "label": f"{point}: no expected baseline, flagged only as a robust outlier"})
            continue
        values = [v for _, v in mine]
        how = "below" if metric == "sqnr_db" else "above"
        rule = f"{point} flag rule: {how} the format's expected {check[0]} by the margin"
        if max(values) - min(values) <= 1e-9 * max(1.0, abs(values[0])):
            out.append({"value": values[0], "rows": None, "color": color,
                        "label": f"{rule} ({values[0] * check[2]:.2f} {check[1]})"})
        else:
            out.append({"value": values[0], "rows": [r for r, _ in mine], "values": values,
                        "color": color, "label": f"{rule} (per site)"})
    return out


def plot_png(report: ScanReport, path: str | os.PathLike[str]) -> Path:
    """report.png: `report_figure`, written atomically."""
    fig = report_figure(report)
    with qio.atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    return Path(path)


def save_report(report: ScanReport, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write report.json, report.csv, report.md and report.png into out_dir, each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "json": qio.write_text(out / FILES[0], report_json(report) + "\n"),
        "csv": qio.write_text(out / FILES[1], to_csv(report)),
        "md": qio.write_text(out / FILES[2], to_markdown(report)),
        "png": plot_png(report, out / FILES[3]),
    }


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.nan


def format_metric(metric: str, value: float) -> str:
    """A metric as table text: percentages for ratios, dB with two decimals."""
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if metric in _PERCENT:
        return f"{100 * value:.2f} %"
    if metric == "sqnr_db":
        return f"{value:.2f}"
    if metric == "cosine":
        return f"{value:.6f}"
    return f"{value:.4g}"


def _ranges(layers: list[int]) -> str:
    return format_layers(layers) if layers else ""


def _md_table(head: list[str], body: list[list[Any]]) -> list[str]:
    def esc(v: object) -> str:
        return str(v).replace("|", "\\|")

    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(esc(v) for v in row) + " |" for row in body
    ]


register_renderer(Renderer(save=save_report, markdown=to_markdown))
