"""Per-site end-to-end sensitivity: what quantizing one site alone does to the model's output.

Weight error ranks sites by what happens to their tensors; this ranks them by what happens to the
model. The model is transformed once under the policy; every `FakeQuantize` is then switched off
and, site by site, only that site's quantizers are switched on (`exact`):

- causal LMs: the KL divergence KL(p_fp ‖ p_q) of the next-token distribution, averaged over every
  position of the calibration set (float64 sums);
- other models (encoders such as all-MiniLM-L6-v2): the output's noise-to-signal ratio
  `nsr = Σ‖h_q − h_fp‖² / Σ‖h_fp‖²` of the final output (SQNR = −10·log10 nsr), plus the mean
  token cosine.

The `estimate` costs one forward and `draws` backward passes per batch for all sites together:
second order in the quantization change Δ of each site (weight, and input for W4A4), with the
first-order change of a random projection of the output (docs/metrics.md):

- causal LMs: labels y sampled from the full-precision model's own next-token distribution make
  the gradient g of −Σ log p(y) a score function, so E[(g·Δ)²] = Σ_t Δᵀ F_t Δ (F_t the Fisher
  information of token t) and KL ≈ ½ Δᵀ F Δ per token: `estimate = ½ Σ (g·Δ)² / tokens`;
- encoders: g of Σ_t z_t·h_t with z ~ N(0, I) gives E[(g·Δ)²] = Σ_t ‖J_t Δ‖² ≈ Σ‖Δh‖², so
  `estimate = Σ (g·Δ)² / Σ‖h_fp‖²` estimates the nsr.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.calibration import Calibration, calibration_batches, run_model
from qtransform.core import io as qio
from qtransform.core.io import encode_floats
from qtransform.errors import UserError
from qtransform.passes import FakeQuantPass
from qtransform.pipeline import transform_program
from qtransform.scan.activations import (
    eval_mode,
    format_policy,
    is_causal_lm,
    primary_output,
    progress_bar,
)
from qtransform.scan.report import VERSION
from qtransform.schemas import Policy, dump_policy, load_policy

SCHEMA = "qtransform.sensitivity"
SCHEMA_VERSION = "1"
METHODS = ("exact", "estimate", "both")
FILES = ("sensitivity.json", "sensitivity.csv", "sensitivity.md", "sensitivity.png")


@dataclass
class SensitivityRow:
    """One site: what quantizing it alone does to the model (`exact`) and the estimate of it."""

    site: str
    layer: int | None
    role: str
    params: int  # weight elements (what keeping the site in high precision costs)
    format: str
    options: dict[str, Any]
    points: list[str]
    exact: float = math.nan  # mean KL per token (causal LM) or output nsr
    estimate: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)  # encoders: sqnr_db, mean_token_cosine
    rank: int | None = None  # 1 = most sensitive, by exact (else by estimate)
    estimate_rank: int | None = None

    def score(self) -> float:
        return self.exact if not math.isnan(self.exact) else self.estimate


@dataclass
class SensitivityReport:
    """Sites ranked by end-to-end sensitivity, with how it was measured (`meta`)."""

    meta: dict[str, Any]
    rows: list[SensitivityRow]

    @property
    def measure(self) -> str:
        return str(self.meta["measure"])

    def ranked(self) -> list[SensitivityRow]:
        return sorted(self.rows, key=lambda r: r.rank or len(self.rows) + 1)

    def to_dict(self) -> dict[str, Any]:
        return encode_floats({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "meta": self.meta,
                              "rows": [dict(r.__dict__) for r in self.ranked()]})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SensitivityReport:
        p = Path(path)
        if p.is_dir():
            p = p / FILES[0]
        data = json.loads(qio.read_input_text(p, "sensitivity report"))
        if data.get("schema") != SCHEMA or data.get("schema_version") != SCHEMA_VERSION:
            raise UserError(f"{p}: not a qtransform sensitivity report of version {SCHEMA_VERSION}; "
                            "re-run `qtransform sensitivity`")
        decode = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
        rows = [SensitivityRow(**{k: decode.get(v, v) if isinstance(v, str) and k in ("exact", "estimate")
                                  else v for k, v in r.items()}) for r in data["rows"]]
        return cls(data["meta"], rows)

    def save(self, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
        """sensitivity.json, .csv, .md and .png (sites by layer), each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        return {
            "json": qio.write_text(out / FILES[0], json.dumps(self.to_dict(), indent=2) + "\n"),
            "csv": qio.write_text(out / FILES[1], self.to_csv()),
            "md": qio.write_text(out / FILES[2], self.to_markdown()),
            "png": self.plot(out / FILES[3]),
        }

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["rank", "site", "layer", "role", "params", "format", "points",
                         f"{self.measure}_exact", f"{self.measure}_estimate", "estimate_rank"])
        for r in self.ranked():
            writer.writerow([r.rank, r.site, "" if r.layer is None else r.layer, r.role, r.params,
                             r.format, "+".join(r.points), r.exact, r.estimate,
                             "" if r.estimate_rank is None else r.estimate_rank])
        return buf.getvalue()

    def table(self, limit: int | None = None) -> list[str]:
        """Markdown table rows, most sensitive first (columns for the measures that were run)."""
        unit = measure_label(self.measure)
        cols = [k for k in ("exact", "estimate") if any(not math.isnan(getattr(r, k)) for r in self.rows)]
        both = len(cols) == 2
        head = ["rank", "site", "layer", *(f"{unit} ({k})" for k in cols), *(["estimate rank"] if both else [])]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.ranked()[:limit]:
            cells = [r.rank, r.site, "" if r.layer is None else r.layer,
                     *(_num(getattr(r, k)) for k in cols), *([r.estimate_rank] if both else [])]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        return lines

    def to_markdown(self) -> str:
        m = self.meta
        lines = [f"# Sensitivity: {m['format']} on {m['source']}", "",
                 f"- {len(self.rows)} sites, quantized one at a time ({'+'.join(m['points'])}); "
                 f"measure: {measure_label(self.measure)} of the {m['output']} on "
                 f"{m['calibration']['tokens']} calibration tokens",
                 f"- method: {m['method']}; {timing_text(m)}"]
        if m.get("spearman") is not None:
            lines.append(f"- estimate vs exact: Spearman {m['spearman']:.3f} over {len(self.rows)} sites")
        lines += ["", *self.table()]
        return "\n".join(lines) + "\n"

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Sites by layer index (log scale), exact and estimate as separate marks."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        rows = self.rows
        xs = [r.layer if r.layer is not None else -1 for r in rows]
        for key, marker, label in (("exact", "o", "exact (one site quantized)"),
                                   ("estimate", "x", "estimate (one backward pass)")):
            ys = [getattr(r, key) for r in rows]
            if any(math.isfinite(y) and y > 0 for y in ys):
                ax.scatter(xs, [y if y > 0 else math.nan for y in ys], marker=marker, s=18,
                           alpha=0.7, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("layer index (-1: outside layers)")
        ax.set_ylabel(measure_label(self.measure))
        ax.set_title(f"Per-site sensitivity: {self.meta['format']} "
                     f"({'+'.join(self.meta['points'])}) on {Path(str(self.meta['source'])).name}")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        with qio.atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
        return Path(path)


def measure_label(measure: str) -> str:
    return {"kl": "KL(fp‖q) per token", "nsr": "output noise/signal"}.get(measure, measure)


def timing_text(meta: dict[str, Any]) -> str:
    parts = []
    if meta.get("exact_seconds_per_site") is not None:
        parts.append(f"exact {meta['exact_seconds_per_site']:.3f} s per site")
    if meta.get("estimate_seconds") is not None:
        parts.append(f"estimate {meta['estimate_seconds']:.2f} s for all sites")
    return ", ".join(parts)


def _num(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.4g}"


# -- the model under test ------------------------------------------------------------------------
@dataclass
class _Quantized:
    """The transformed model and, per site, its FakeQuantize modules by point."""

    model: nn.Module
    program: Any
    quantizers: dict[str, dict[str, nn.Module]]

    def enable(self, sites: set[str]) -> None:
        for site, by_point in self.quantizers.items():
            for module in by_point.values():
                module.enabled = site in sites


def _prepare(model: nn.Module, policy: Policy) -> _Quantized:
    program = transform_program(model, policy)
    quant = program.module()
    found: dict[str, dict[str, nn.Module]] = {}
    for ins in program.insertions(pass_name=FakeQuantPass.name):
        found.setdefault(ins.site, {})[ins.point] = quant.get_submodule(ins.module_path)
    if not found:
        raise UserError("the policy quantizes nothing: no site to measure")
    return _Quantized(quant, program, found)


@contextmanager
def _enabled(q: _Quantized, sites: set[str]) -> Iterator[None]:
    q.enable(sites)
    try:
        yield
    finally:
        q.enable(set(q.quantizers))


class _Reference:
    """Full-precision outputs per batch and the end-to-end measure of a run against them."""

    def __init__(self, causal: bool):
        self.causal = causal
        self.outputs: list[Tensor] = []
        self.signal = 0.0
        self.tokens = 0

    def add(self, out: Tensor) -> None:
        out = out.detach().double()
        if self.causal:
            out = torch.log_softmax(out, dim=-1)
        else:
            self.signal += float((out**2).sum())
        self.tokens += out.numel() // out.shape[-1]
        self.outputs.append(out)

    def compare(self, index: int, out: Tensor) -> tuple[float, float]:
        """(sum of per-token KL or of squared error, sum of token cosines) for one batch."""
        ref = self.outputs[index]
        out = out.detach().double()
        if self.causal:
            logq = torch.log_softmax(out, dim=-1)
            kl = float((ref.exp() * (ref - logq)).sum())
            return kl, math.nan
        a, b = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
        cos = float(((a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))).sum())
        return float(((a - b) ** 2).sum()), cos

    def result(self, total: float, cosines: float) -> tuple[float, dict[str, float]]:
        if self.causal:
            return total / self.tokens, {}
        nsr = total / self.signal
        sqnr = -10 * math.log10(nsr) if nsr > 0 else math.inf
        return nsr, {"sqnr_db": sqnr, "mean_token_cosine": cosines / self.tokens}


def _run(model: nn.Module, batches: list[Tensor], ref: _Reference) -> tuple[float, dict[str, float]]:
    total = cosines = 0.0
    with torch.no_grad():
        for i, batch in enumerate(batches):
            kl, cos = ref.compare(i, primary_output(run_model(model, batch)))
            total += kl
            cosines += 0.0 if math.isnan(cos) else cos
    return ref.result(total, cosines)


# -- the estimate --------------------------------------------------------------------------------
def _estimate(q: _Quantized, batches: list[Tensor], ref: _Reference, draws: int,
              seed: int) -> dict[str, float]:
    """Σ over batches and draws of (g·Δ)² per site (see the module docstring), normalized."""
    model = q.model
    params = [p for p in model.parameters() if p.is_floating_point()]
    flags = [p.requires_grad for p in params]
    sums = dict.fromkeys(q.quantizers, 0.0)
    weights: dict[str, tuple[Tensor, Tensor]] = {}
    sites = dict(model.named_modules())
    for name, by_point in q.quantizers.items():
        if "weight" in by_point:
            w = sites[name].weight
            weights[name] = (w, (by_point["weight"].quantized_copy(w) - w.detach()))
    gen = torch.Generator().manual_seed(seed)
    captured: dict[str, tuple[Tensor, Tensor]] = {}

    def grab(site: str):
        def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            captured[site] = (out, module.quantized_copy(out) - out.detach())
        return hook

    handles = [by_point["input"].register_forward_hook(grab(name))
               for name, by_point in q.quantizers.items() if "input" in by_point]
    q.enable(set())
    try:
        for p in params:
            p.requires_grad_(True)
        for batch in batches:
            captured.clear()
            out = primary_output(run_model(model, batch)).float()
            for d in range(draws):
                if ref.causal:
                    with torch.no_grad():
                        probs = torch.softmax(out.detach().reshape(-1, out.shape[-1]).double(), -1)
                        labels = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                    objective = torch.nn.functional.cross_entropy(
                        out.reshape(-1, out.shape[-1]), labels, reduction="sum")
                else:
                    z = torch.randn(out.shape, generator=gen, dtype=out.dtype)
                    objective = (out * z).sum()
                names = list(weights) + list(captured)
                tensors = [weights[n][0] for n in weights] + [captured[n][0] for n in captured]
                grads = torch.autograd.grad(objective, tensors, retain_graph=d < draws - 1,
                                            allow_unused=True)
                dots = dict.fromkeys(q.quantizers, 0.0)
                for n, g, kind in zip(names, grads, ["w"] * len(weights) + ["x"] * len(captured),
                                      strict=True):
                    if g is not None:
                        delta = weights[n][1] if kind == "w" else captured[n][1]
                        dots[n] += float((g.double() * delta.double()).sum())
                for n, v in dots.items():
                    sums[n] += v * v / draws
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
            p.grad = None
        q.enable(set(q.quantizers))
    scale = 0.5 / ref.tokens if ref.causal else 1.0 / ref.signal
    return {n: v * scale for n, v in sums.items()}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN with fewer than 2 pairs."""
    if len(a) < 2:
        return math.nan
    ra, rb = _avg_ranks(a), _avg_ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else math.nan


def _avg_ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _ranks_desc(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: (-values[i] if not math.isnan(values[i]) else math.inf, i))
    out = [0] * len(values)
    for rank, i in enumerate(order, 1):
        out[i] = rank
    return out


# -- public API ----------------------------------------------------------------------------------
def sensitivity_policy(model: nn.Module, policy_or_format: Any, *, activations: bool = False,
                       options: dict[str, Any] | None = None) -> Policy:
    """A format name means W4A16 on every linear site but the LM head (`activations=True`: W4A4,
    weight and input quantized); a policy is used as given."""
    if isinstance(policy_or_format, str) and not Path(policy_or_format).exists():
        policy = dump_policy(format_policy(model, policy_or_format, options))
        if activations:
            policy["quantize"][0]["tensors"] = ["weight", "input"]
        return load_policy(policy)
    return load_policy(policy_or_format)


def site_sensitivity(model: nn.Module, policy_or_format: Any, calib: Calibration, *,
                     tokenizer: Any = None, method: str = "exact", activations: bool = False,
                     draws: int = 4, seed: int = 0, batch_size: int = 8, max_length: int = 128,
                     progress: bool | None = False) -> SensitivityReport:
    """Rank the policy's quantized sites by what quantizing each alone does to the model's output
    (see the module docstring for the measures). `method`: exact (one run per site), estimate
    (one forward and `draws` backward passes per batch for all sites) or both (then
    `meta.spearman` records their agreement). `model` is left as it was."""
    if method not in METHODS:
        raise UserError(f"method {method!r}: use one of {', '.join(METHODS)}")
    if draws < 1:
        raise UserError("draws must be at least 1")
    policy = sensitivity_policy(model, policy_or_format, activations=activations)
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    causal = is_causal_lm(model)
    with eval_mode(model):
        q = _prepare(model, policy)
        q.model.eval()
        ref = _Reference(causal)
        with _enabled(q, set()), torch.no_grad():
            for batch in batches:
                ref.add(primary_output(run_model(q.model, batch)))
        sites = q.program.sites
        rows = []
        for name, by_point in q.quantizers.items():
            fq = next(iter(by_point.values()))
            shape = sites[name].weight_shape or ()
            rows.append(SensitivityRow(name, sites[name].layer, sites[name].role, math.prod(shape),
                                       fq.config.name, fq.config.options(), sorted(by_point)))
        meta: dict[str, Any] = {}
        if method in ("exact", "both"):
            start = time.perf_counter()
            for row in progress_bar(rows, progress, "sensitivity"):
                with _enabled(q, {row.site}):
                    row.exact, row.extra = _run(q.model, batches, ref)
            meta["exact_seconds_per_site"] = (time.perf_counter() - start) / len(rows)
        if method in ("estimate", "both"):
            start = time.perf_counter()
            est = _estimate(q, batches, ref, draws, seed)
            meta["estimate_seconds"] = time.perf_counter() - start
            for row in rows:
                row.estimate = est[row.site]
    for row, rank in zip(rows, _ranks_desc([r.score() for r in rows]), strict=True):
        row.rank = rank
    if method in ("estimate", "both"):
        for row, rank in zip(rows, _ranks_desc([r.estimate for r in rows]), strict=True):
            row.estimate_rank = rank
    fmts = sorted({r.format for r in rows})
    meta = {
        "source": type(model).__name__, "format": fmts[0] if len(fmts) == 1 else "mixed",
        "points": sorted({p for r in rows for p in r.points}), "method": method,
        "measure": "kl" if causal else "nsr", "output": "logits" if causal else "final output",
        "draws": draws if method != "exact" else None, "seed": seed,
        "quantize": [r.model_dump(mode="json", exclude_defaults=True) for r in policy.quantize],
        "calibration": {"batches": len(batches), "samples": sum(len(b) for b in batches),
                        "tokens": ref.tokens, "batch_size": batch_size, "max_length": max_length},
        "spearman": spearman([r.exact for r in rows], [r.estimate for r in rows])
        if method == "both" else None,
        **meta, "qtransform_version": VERSION,
    }
    return SensitivityReport(meta, rows)


def measure_policy(model: nn.Module, policy: Any, calib: Calibration, *, tokenizer: Any = None,
                   batch_size: int = 8, max_length: int = 128) -> float:
    """The end-to-end measure (mean KL per token, or output nsr) of a whole policy at once: what
    a budgeted policy's prediction (the sum of its quantized sites' sensitivities) is checked by."""
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    with eval_mode(model):
        q = _prepare(model, load_policy(policy))
        q.model.eval()
        ref = _Reference(is_causal_lm(model))
        with _enabled(q, set()), torch.no_grad():
            for batch in batches:
                ref.add(primary_output(run_model(q.model, batch)))
        return _run(q.model, batches, ref)[0]
