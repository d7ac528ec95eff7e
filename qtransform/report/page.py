"""One self-contained HTML page: the medium a researcher can send to a colleague as one file.

A page opens from disk, offline: styles, scripts and figure data are inline and nothing is fetched
from the network (no `<script src>`, no `<link href>`). Figures are Plotly figures; plotly.js is
inlined once per page, gzip-compressed and base64-encoded (4.8 MB of minified JS becomes about
1.9 MB) and unpacked by the browser's own `DecompressionStream`, so a 28-layer report stays far
below 5 MB (docs/reports.md, docs/benchmarks.md). The only hand-written JavaScript sorts and
filters tables and switches the detail view; everything drawn is drawn by Plotly.

    page = Page("Weight scan: mxfp4 on tiny", {"model": "tiny", "seed": 0})
    page.section("Overview", "What this page shows, in words.")
    page.heatmap(layers=[0, 1], roles=["q_proj", "k_proj"], values=[[30.1, 28.0], [29.5, None]],
                 title="SQNR by layer and role", colorbar_title="dB")
    page.table([{"site": "model.layers.0.q_proj", "sqnr_db": 30.1}], id="sites")
    page.flags([("model.layers.1.k_proj", "SQNR 12.0 dB is below the 20 dB threshold")])
    page.detail("Per-site detail", {"model.layers.0.q_proj": go.Figure(...)})
    page.figure(go.Figure(...))
    page.link("activation scan", "../activations/report.html")
    page.write("out/report.html")

`code` shows preformatted text. `table` takes rows as dicts (columns: the keys in first-seen order unless given); numbers are
shown with 4 significant digits and sorted as numbers. `flags` takes (site, reason in words)
pairs. `write` is atomic (qtransform.core.io). Blocks appear in the order they were added.
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import math
import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qtransform.core import io as qio

if TYPE_CHECKING:
    from plotly.graph_objects import Figure

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table.meta td{padding:1px 8px;vertical-align:top}table.meta td:first-child{color:#666}
.tablewrap{max-height:520px;overflow:auto;border:1px solid #ddd}
table.data{border-collapse:collapse;font-size:12px;width:100%}
table.data th{position:sticky;top:0;background:#f3f3f3;cursor:pointer;text-align:left;padding:3px 6px}
table.data td{padding:2px 6px;border-top:1px solid #eee;white-space:nowrap}
table.data td.num{text-align:right;font-variant-numeric:tabular-nums}
table.data tr.flagged td{background:#fde8e8}
input.filter{margin:4px 0;padding:3px 6px;width:320px}
ul.flags li{margin:2px 0}ul.flags code{color:#a00}
.qt-figure{min-height:200px}pre{background:#f6f6f6;padding:8px;overflow:auto}.count{color:#666;margin-left:8px}
"""

# Sorting and filtering of tables, the detail selector, and the start of plotly.js: the page's
# only hand-written script. Figures wait for plotly.js (unpacked asynchronously), then draw.
_SCRIPT = """
function qtSort(th){const t=th.closest('table'),b=t.tBodies[0],i=th.cellIndex,
asc=th.dataset.dir!=='asc';th.dataset.dir=asc?'asc':'desc';
const key=r=>{const c=r.cells[i],v=c.dataset.v;return v===undefined?c.textContent:parseFloat(v)};
[...b.rows].sort((x,y)=>{const a=key(x),c=key(y);
const r=(typeof a==='number'&&typeof c==='number')?((isNaN(a)?1e308:a)-(isNaN(c)?1e308:c))
:String(a).localeCompare(String(c),undefined,{numeric:true});return asc?r:-r}).forEach(r=>b.appendChild(r))}
function qtFilter(inp){const t=document.getElementById(inp.dataset.table),q=inp.value.toLowerCase();
let n=0;for(const r of t.tBodies[0].rows){const s=r.textContent.toLowerCase().includes(q);
r.style.display=s?'':'none';n+=s}document.getElementById(inp.dataset.table+'-count').textContent=n+' shown'}
function qtData(id){return JSON.parse(document.getElementById(id).textContent)}
function qtDraw(div,fig){Plotly.react(div,fig.data,fig.layout||{},{responsive:true,displaylogo:false})}
function qtDetail(sel){const all=qtData(sel.dataset.src);qtDraw(document.getElementById(sel.dataset.div),all[sel.value])}
async function qtStart(){const b64=document.getElementById('qt-plotly').textContent;
const bytes=Uint8Array.from(atob(b64),c=>c.charCodeAt(0));
const js=await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
const s=document.createElement('script');s.textContent=js;document.head.appendChild(s);
for(const d of document.querySelectorAll('div.qt-figure[data-src]'))qtDraw(d,qtData(d.dataset.src));
for(const s of document.querySelectorAll('select.qt-detail'))qtDetail(s);
document.body.dataset.figures='drawn'}
if(document.getElementById('qt-plotly'))qtStart();
"""


@lru_cache(maxsize=1)
def _plotly_bundle() -> str:
    """plotly.js (from the installed plotly package), gzip-compressed and base64-encoded."""
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode(), compresslevel=6, mtime=0)).decode()


def _json(text: str) -> str:
    """JSON text made safe inside a <script> element (no `</` can close it early)."""
    return text.replace("</", "<\\/")


def _figure_json(fig: Figure | dict[str, Any]) -> str:
    """A Plotly figure (or its dict) as JSON, through plotly's own encoder (numpy arrays)."""
    if isinstance(fig, dict):  # already plain data: plotly.py's encoder would only slow it down
        return _json(json.dumps(fig, allow_nan=False))
    import plotly.io as pio

    return _json(pio.to_json(fig, validate=False, remove_uids=True))


def _cell(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return f"<td>{'' if value is None else html.escape(str(value))}</td>"
    if isinstance(value, int | float):
        v = float(value)
        text = f"{value}" if isinstance(value, int) else ("n/a" if math.isnan(v) else f"{v:.4g}")
        key = repr(v) if math.isfinite(v) else {"inf": "Infinity", "-inf": "-Infinity"}.get(str(v), "NaN")
        return f'<td class="num" data-v="{key}">{text}</td>'
    return f"<td>{html.escape(str(value))}</td>"


class Page:
    """An HTML page built block by block; `html()` renders it, `write(path)` saves it."""

    def __init__(self, title: str, metadata: dict[str, Any] | None = None):
        self.title = title
        self.metadata = dict(metadata or {})
        self._blocks: list[str] = []
        self._ids = 0
        self._plotly = False

    def _id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids}"

    def section(self, title: str, text: str | None = None) -> Page:
        """A heading, and a paragraph of explanation in words."""
        self._blocks.append(f"<h2>{html.escape(title)}</h2>")
        if text:
            self._blocks.append(f"<p>{html.escape(text)}</p>")
        return self

    def text(self, text: str) -> Page:
        """A paragraph."""
        self._blocks.append(f"<p>{html.escape(text)}</p>")
        return self

    def code(self, text: str) -> Page:
        """Preformatted text (a policy, a command)."""
        self._blocks.append(f"<pre>{html.escape(text)}</pre>")
        return self

    def table(self, rows: list[dict[str, Any]], columns: list[str] | None = None, *,
              sortable: bool = True, filterable: bool = True, id: str | None = None,
              flagged: list[bool] | None = None) -> Page:
        """A data table, one row per dict; click a header to sort, type to filter. `flagged`
        marks rows (same length as `rows`) with a red background."""
        cols = columns or list(dict.fromkeys(k for r in rows for k in r))
        tid = id or self._id("table")
        head = "".join(f"<th{' onclick=qtSort(this)' if sortable else ''}>{html.escape(str(c))}</th>"
                       for c in cols)
        body = "".join(
            f"<tr{' class=flagged' if flagged and flagged[i] else ''}>"
            + "".join(_cell(r.get(c)) for c in cols) + "</tr>" for i, r in enumerate(rows))
        parts = []
        if filterable:
            parts.append(f'<input class="filter" placeholder="filter rows" data-table="{tid}" '
                         f'oninput="qtFilter(this)"><span class="count" id="{tid}-count">'
                         f"{len(rows)} shown</span>")
        parts.append(f'<div class="tablewrap"><table class="data" id="{tid}"><thead><tr>{head}'
                     f"</tr></thead><tbody>{body}</tbody></table></div>")
        self._blocks.append("".join(parts))
        return self

    def figure(self, fig: Figure | dict[str, Any]) -> Page:
        """A Plotly figure (go.Figure or its dict), drawn by plotly.js in the browser."""
        self._plotly = True
        fid = self._id("fig")
        self._blocks.append(f'<div class="qt-figure" id="{fid}" data-src="{fid}-data"></div>'
                            f'<script type="application/json" id="{fid}-data">{_figure_json(fig)}</script>')
        return self

    def heatmap(self, layers: list[Any], roles: list[str], values: list[list[float | None]],
                title: str, colorbar_title: str, *, reverse: bool = False,
                center: float | None = None, span: float | None = None) -> Page:
        """A layer × role grid: `values[i][j]` is role i at layer j (None: no such site).
        Higher is better unless `reverse` (then the color scale is flipped). `span` keeps the
        colors honest: the scale covers at least center ± span (center: the middle of the
        values unless given, e.g. the format's expected SQNR), so a 0.5 dB spread is not drawn
        as red against green."""
        import plotly.graph_objects as go

        z = [[None if v is None or not math.isfinite(v) else v for v in row] for row in values]
        finite = [v for row in z for v in row if v is not None]
        scale: dict[str, float] = {}
        if span is not None and finite:
            lo, hi = min(finite), max(finite)
            mid = (lo + hi) / 2 if center is None else center
            half = max(span, hi - mid, mid - lo) if center is None else span
            scale = {"zmin": mid - half, "zmax": mid + half}
        fig = go.Figure(go.Heatmap(
            z=z, x=[str(x) for x in layers], y=list(roles), colorscale="RdYlGn", reversescale=reverse,
            **scale,
            colorbar={"title": {"text": colorbar_title}}, hoverongaps=False,
            hovertemplate="layer %{x}, %{y}: %{z:.4g}<extra></extra>"))
        fig.update_layout(title=title, xaxis={"title": "layer", "type": "category"},
                          height=max(260, 60 + 26 * len(roles)), margin={"t": 50, "b": 40})
        return self.figure(fig)

    def detail(self, title: str, figures: dict[str, Any]) -> Page:
        """Per-item detail: a selector over `figures` (name -> Plotly figure); one is drawn at a
        time, so a page with hundreds of sites stays quick to open."""
        if not figures:
            return self
        self._plotly = True
        did = self._id("detail")
        data = "{" + ",".join(f"{json.dumps(k)}:{_figure_json(f)}" for k, f in figures.items()) + "}"
        options = "".join(f"<option>{html.escape(k)}</option>" for k in figures)
        self._blocks.append(
            f"<p>{html.escape(title)}: <select class=\"qt-detail\" data-src=\"{did}-data\" "
            f"data-div=\"{did}\" onchange=\"qtDetail(this)\">{options}</select></p>"
            f'<div class="qt-figure" id="{did}"></div>'
            f'<script type="application/json" id="{did}-data">{_json(data)}</script>')
        return self

    def flags(self, flags: list[tuple[str, str]]) -> Page:
        """The flagged sites with their reasons in words ("none" when the list is empty)."""
        if not flags:
            self._blocks.append("<p>No site is flagged.</p>")
            return self
        items = "".join(f"<li><code>{html.escape(site)}</code>: {html.escape(reason)}</li>"
                        for site, reason in flags)
        self._blocks.append(f'<ul class="flags">{items}</ul>')
        return self

    def link(self, text: str, href: str) -> Page:
        """A link to another page of the run (a relative path: pages move together)."""
        self._blocks.append(f'<p><a href="{html.escape(href, quote=True)}">{html.escape(text)}</a></p>')
        return self

    def html(self) -> str:
        """The whole page as one string."""
        meta = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_meta_text(v))}</td></tr>"
                       for k, v in self.metadata.items())
        bundle = (f'<script type="application/octet-stream" id="qt-plotly">{_plotly_bundle()}</script>'
                  if self._plotly else "")
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<title>{html.escape(self.title)}</title><style>{_STYLE}</style></head><body>"
                f"<h1>{html.escape(self.title)}</h1><table class=\"meta\">{meta}</table>"
                + "\n".join(self._blocks) + f"{bundle}<script>{_SCRIPT}</script></body></html>\n")

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the page atomically."""
        return qio.write_text(path, self.html())


def _meta_text(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def page_beside(path: str | os.PathLike[str]) -> Path:
    """Where the page of a single-file result goes: `policy.json` -> `policy.html`."""
    p = Path(path)
    page = p.with_suffix(".html")
    return page if page != p else p.with_name(p.name + ".page.html")
