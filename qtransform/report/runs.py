"""The page of runs side by side (`qtransform report A B ...`): `scan.runs.compare_runs`'s
comparison as one HTML page, and the function that writes its folder (JSON, Markdown, HTML)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from qtransform.core import io as qio
from qtransform.report.page import Page
from qtransform.scan.runs import DEFAULT_THRESHOLD_DB, RunComparison, compare_runs

PAGE = "comparison.html"


def comparison_page(comparison: RunComparison, out: str | os.PathLike[str] | None = None) -> Page:
    """Per later run: what got worse or better and the flags that moved (in words), a layer ×
    role heatmap of the main metric's delta where the sites have layers and roles, and the
    sortable table of every aligned site (rows that got worse are marked); with `out` (the folder
    the page goes to), links to each run's own page."""
    c = comparison
    first = c.runs[0]
    main = "sqnr_db" if c.kind == "scan" else "score_db"
    unit = "SQNR" if c.kind == "scan" else "sensitivity"
    page = Page(f"{c.kind.capitalize()} runs side by side: " + " vs ".join(r.label for r in c.runs), {
        **{f"run {r.label}": f"{r.path}" for r in c.runs},
        "baseline": first.label, "threshold": f"{c.threshold_db:g} dB",
        "sites aligned": len(c.keys),
    })
    page.section("How to read this page",
                 f"Sites are aligned by name; every later run is compared with {first.label}: a "
                 f"delta is later minus {first.label}"
                 + ("" if c.kind == "scan" else " of the score as 10·log10 (a ratio in dB)")
                 + f". A site got worse when its {unit} moved the wrong way by more than "
                 f"{c.threshold_db:g} dB.")
    if out is not None:  # each run's own page, where the command that wrote it left one
        for run in c.runs:
            own = run.path.with_suffix(".html")
            if own.is_file():
                page.link(f"{run.label}: its own page", os.path.relpath(own.resolve(), Path(out).resolve()))
    for i in range(1, len(c.runs)):
        run = c.runs[i]
        page.section(f"{run.label} against {first.label}")
        moved = [(k, f"{c.change(k, i)}: {unit} {c.delta(k, main, i):+.2f} dB")
                 for k in c.keys if c.change(k, i)]
        page.text(f"{sum(c.change(k, i) == 'worse' for k in c.keys)} sites worse, "
                  f"{sum(c.change(k, i) == 'better' for k in c.keys)} better.")
        page.flags(moved)
        if c.kind == "scan":
            flags = []
            for k in c.keys:
                appeared, gone = c.flags(k, i)
                flags += [(k, f"new flag: {f}") for f in appeared]
                flags += [(k, f"flag gone: {f}") for f in gone]
            page.text("Flags that appear or disappear:")
            page.flags(flags)
        grid = _grid(c, main, i)
        if grid is not None:
            layers, roles, values = grid
            page.heatmap(layers, roles, values, title=f"Δ {unit} ({run.label} − {first.label}) by "
                         "layer and role", colorbar_title="dB", reverse=c.kind != "scan")
    page.section("Sites", "Every aligned site: values per run, deltas, and the change.")
    rows, worse = [], []
    for k in c.keys:
        row: dict[str, Any] = {"site": k}
        for r in c.runs:
            row[f"{main} {r.label}"] = r.sites[k][main]
        for i in range(1, len(c.runs)):
            row[f"Δ {c.runs[i].label}"] = c.delta(k, main, i)
            row[f"change {c.runs[i].label}"] = c.change(k, i)
        rows.append(row)
        worse.append(any(c.change(k, i) == "worse" for i in range(1, len(c.runs))))
    page.table(rows, id="sites", flagged=worse)
    for label, keys in c.only.items():
        if keys:
            page.text(f"Only in {label} ({len(keys)}): " + ", ".join(keys))
    return page


def _grid(c: RunComparison, main: str, run: int) -> tuple[list[int], list[str], list[list[float | None]]] | None:
    """(layers, roles, values[role][layer]) of the delta, weight points only; None when the
    sites carry no layer × role structure."""
    cells: dict[tuple[int, str], float] = {}
    for k in c.keys:
        site = c.runs[0].sites[k]
        if site.get("layer") is None or not site.get("role") or " [" in k:
            continue
        d = c.delta(k, main, run)
        cells[(site["layer"], site["role"])] = d if math.isfinite(d) else math.nan
    if not cells:
        return None
    layers = sorted({layer for layer, _ in cells})
    roles = list(dict.fromkeys(role for _, role in cells))
    return layers, roles, [[cells.get((layer, role)) for layer in layers] for role in roles]


def report_runs(paths: list[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                labels: list[str] | None = None, threshold_db: float = DEFAULT_THRESHOLD_DB,
                force: bool = False) -> RunComparison:
    """Compare result folders side by side (`compare_runs`) and write comparison.json, .md and
    .html into `out` (a folder replaced as a whole, atomically; `force` as for every command).

    Args:
        paths: two or more result folders of one model and one kind (scan, sensitivity, parity).
        out: the output folder.
        labels: a short name per run (default: the folder names).
        threshold_db: how far a site must move (dB) to count as worse or better.
        force: replace `out` even when qtransform did not write it.

    Example:
        qtransform.report_runs(["scans/mxfp4", "scans/nvfp4"], "cmp")
    """
    comparison = compare_runs(paths, labels=labels, threshold_db=threshold_db)
    with qio.output_folder(out, "report", force=force, protect=[str(p) for p in paths]) as staging:
        comparison.save(staging)
        comparison_page(comparison, out).write(Path(staging) / PAGE)
    return comparison
