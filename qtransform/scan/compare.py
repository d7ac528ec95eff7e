"""The result of comparing formats on the same tensors: totals, winners, and warnings.

Kept apart from the scanning loop (`qtransform.scan.compare_formats`) because it is pure
bookkeeping on metric dicts: which format wins each metric, and an explanation whenever the mean
relative error ranks formats opposite to SQNR (the trap described in docs/metrics.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.core.result import decode_numbers, json_file
from qtransform.errors import UserError
from qtransform.scan.render import format_metric
from qtransform.scan.report import ScanReport

SCHEMA = "qtransform.comparison"
FILES = ("comparison.json", "comparison.md")

COMPARED_METRICS = {  # metric -> True when higher is better
    "sqnr_db": True, "mse": False, "rmse": False, "cosine": True, "max_abs_error": False,
    "deadzone": False, "mean_rel_error": False,
}


@dataclass
class Comparison:
    """Several formats over the same weights: model-wide totals, per-metric winners, notes."""

    formats: list[str]
    totals: dict[str, dict[str, float]]  # format -> metrics of all its errors summed up
    winners: dict[str, str]  # metric -> best format ("tie" when equal)
    notes: list[str]
    reports: dict[str, ScanReport]

    @classmethod
    def of(cls, totals: dict[str, dict[str, float]], reports: dict[str, ScanReport]) -> Comparison:
        """Rank the formats on every compared metric and explain the disagreements."""
        winners = {m: _winner(totals, m, higher) for m, higher in COMPARED_METRICS.items()}
        return cls(list(totals), totals, winners, _disagreements(totals), reports)

    def per_layer(self) -> list[dict[str, Any]]:
        """Where the formats differ: per decoder layer (then `None` for the sites outside layers,
        such as lm_head), each format's SQNR of the layer's weights (merged sums) and the winner."""
        reports = self.reports
        first = next(iter(reports.values()))
        layers: list[int | None] = list(first.layers())
        if any(r.layer is None for r in first.rows):
            layers.append(None)
        out = []
        for layer in layers:
            sqnr = {f: rep.aggregate([r for r in rep.rows if r.layer == layer])["sqnr_db"]
                    for f, rep in reports.items()}
            out.append({"layer": layer, "sites": sum(r.layer == layer for r in first.rows),
                        "sqnr_db": sqnr, "winner": _winner({f: {"sqnr_db": v} for f, v in sqnr.items()},
                                                           "sqnr_db", True)})
        return out

    def to_dict(self) -> dict[str, Any]:
        """Totals, winners, per-layer SQNR and notes (comparison.json adds each format's report)."""
        return encode_floats({
            "schema": SCHEMA, "schema_version": "1",
            "formats": self.formats, "totals": self.totals, "winners": self.winners,
            "layers": self.per_layer(), "notes": self.notes,
            "options": {f: r.meta.get("options", {}) for f, r in self.reports.items()},
            "sites": len(next(iter(self.reports.values())).rows),
        })

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """comparison.json (with each format's report, so `load` reads it whole) and
        comparison.md, each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        data = {**self.to_dict(), "reports": {f: r.to_dict() for f, r in self.reports.items()}}
        return {"json": qio.write_json(out / FILES[0], data),
                "md": qio.write_text(out / FILES[1], self.markdown())}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Comparison:
        """Read comparison.json (or the folder `save` wrote)."""
        p = json_file(path, FILES[0])
        text = qio.read_input_text(p, "format comparison (give comparison.json or its folder)")
        try:
            data = json.loads(text)
            if data.get("schema") != SCHEMA or "reports" not in data:
                raise ValueError("not a format comparison of this version")
            reports = {f: ScanReport.from_dict(r) for f, r in data["reports"].items()}
            return cls(list(data["formats"]), decode_numbers(data["totals"]), dict(data["winners"]),
                       list(data["notes"]), reports)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{p}: not a format comparison this qtransform version can read "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                            "re-run `qtransform compare`") from None

    def to_markdown(self) -> str:
        """The same as `markdown` (the name README examples use)."""
        return self.markdown()

    def markdown(self) -> str:
        head = "| metric | " + " | ".join(self.formats) + " | better |"
        lines = [head, "|" + "---|" * (len(self.formats) + 2)]
        for metric in COMPARED_METRICS:
            cells = [format_metric(metric, self.totals[f][metric]) for f in self.formats]
            lines.append(f"| {metric} | " + " | ".join(cells) + f" | {self.winners[metric]} |")
        if any("max4_share" in t for t in self.totals.values()):  # four-over-six columns
            cells = [f"{100 * self.totals[f]['max4_share']:.1f} %" if "max4_share" in self.totals[f]
                     else "-" for f in self.formats]
            lines.append("| max/4 blocks | " + " | ".join(cells) + " | |")
        lines += ["", "## Per layer (SQNR dB of each layer's weights)", "",
                  "| layer | sites | " + " | ".join(self.formats) + " | better |",
                  "|" + "---|" * (len(self.formats) + 3)]
        layers = self.per_layer()
        overall = self.winners["sqnr_db"]
        for e in layers:
            cells = [format_metric("sqnr_db", e["sqnr_db"][f]) for f in self.formats]
            mark = " (differs)" if e["winner"] != overall else ""
            lines.append(f"| {'-' if e['layer'] is None else e['layer']} | {e['sites']} | "
                         + " | ".join(cells) + f" | {e['winner']}{mark} |")
        differ = [e for e in layers if e["winner"] != overall]
        lines += ["", f"{overall} is better in {len(layers) - len(differ)} of these {len(layers)} rows"
                  + (": elsewhere " + ", ".join(f"{'-' if e['layer'] is None else e['layer']} ({e['winner']})"
                                                 for e in differ) if differ else ".")]
        return "\n".join(lines + [""] + [f"> {note}" for note in self.notes]) + "\n"


def _winner(results: dict[str, dict[str, float]], metric: str, higher: bool) -> str:
    vals = {f: r[metric] for f, r in results.items() if not math.isnan(r[metric])}
    if not vals:
        return "n/a"
    best = max(vals.values()) if higher else min(vals.values())
    top = [f for f, v in vals.items() if v == best]
    return top[0] if len(top) == 1 else "tie"


def _disagreements(results: dict[str, dict[str, float]]) -> list[str]:
    """Explain every pair where mean relative error ranks opposite to SQNR (the seed's trap)."""
    notes = []
    names = list(results)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = (first, second) if results[first]["sqnr_db"] >= results[second]["sqnr_db"] else (second, first)
            ra, rb = results[a], results[b]
            if not (ra["sqnr_db"] > rb["sqnr_db"] and ra["mean_rel_error"] > rb["mean_rel_error"]):
                continue
            why = (
                f"{a} zeroes more small weights (deadzone {100 * ra['deadzone']:.2f} % vs "
                f"{100 * rb['deadzone']:.2f} %), and each zeroed weight counts as a 100 % error"
                if ra["deadzone"] > rb["deadzone"]
                else "small weights with large relative errors dominate the mean"
            )
            notes.append(
                f"{a} is better by SQNR ({ra['sqnr_db']:.2f} vs {rb['sqnr_db']:.2f} dB) but worse by "
                f"mean relative error ({100 * ra['mean_rel_error']:.2f} % vs "
                f"{100 * rb['mean_rel_error']:.2f} %): mean(|x - q| / |x|) weighs every element "
                f"equally however small, and {why}. Small weights carry little of the signal, so "
                f"rank formats by SQNR / MSE (docs/metrics.md)."
            )
    return notes
