"""Per-site end-to-end sensitivity: what quantizing one site alone does to the model's output.

This module measures; the result is a `SensitivityReport` (scan/sensitivity_report.py), and
budgets read it (scan/budget.py).

Weight error ranks sites by what happens to their tensors; this ranks them by what happens to the
model. The model is transformed once under the policy; every `FakeQuantize` is then switched off
and, site by site, only that site's quantizers are switched on (`exact`):

- causal LMs: the KL divergence KL(p_fp ‖ p_q) of the next-token distribution, averaged over every
  position of the calibration set (float64 sums);
- other models (encoders such as all-MiniLM-L6-v2): the output's noise-to-signal ratio
  `nsr = Σ‖h_q − h_fp‖² / Σ‖h_fp‖²` of the final output (SQNR = −10·log10 nsr), plus the mean
  token cosine.

The `estimate` costs one forward and `draws` backward passes per batch for all sites together:
second order in the quantization change Δ of each site (weight, input for W4A4, an attention
site's query/key/value/probs: a site's quantizers are one unit), with the
first-order change of a random projection of the output (docs/metrics.md):

- causal LMs: labels y sampled from the full-precision model's own next-token distribution make
  the gradient g of −Σ log p(y) a score function, so E[(g·Δ)²] = Σ_t Δᵀ F_t Δ (F_t the Fisher
  information of token t) and KL ≈ ½ Δᵀ F Δ per token: `estimate = ½ Σ (g·Δ)² / tokens`;
- encoders: g of Σ_t z_t·h_t with z ~ N(0, I) gives E[(g·Δ)²] = Σ_t ‖J_t Δ‖² ≈ Σ‖Δh‖², so
  `estimate = Σ (g·Δ)² / Σ‖h_fp‖²` estimates the nsr.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qtransform.calibration import Calibration, run_model
from qtransform.core.progress import Progress
from qtransform.errors import UserError
from qtransform.formats import fastpath
from qtransform.passes import FakeQuantPass
from qtransform.scan.remedy import Rotation
from qtransform.scan.report import VERSION
from qtransform.scan.sensitivity_report import SensitivityReport, SensitivityRow
from qtransform.scan.setup import (
    CalibrationSpec,
    ScanSetup,
    eval_mode,
    prepare_scan,
    primary_output,
)
from qtransform.schemas import dump_policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qtransform.schemas import PolicyLike

METHODS = ("exact", "estimate", "both")


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


def _quantized(setup: ScanSetup) -> _Quantized:
    program, quant = setup.program, setup.quant
    found: dict[str, dict[str, nn.Module]] = {}
    for ins in program.insertions(pass_name=FakeQuantPass.name):
        found.setdefault(ins.site, {})[ins.point] = quant.get_submodule(ins.module_path)
    if not found:
        raise UserError("the policy quantizes nothing: no site to measure")
    quant.eval()
    return _Quantized(quant, program, found)


def _reference(q: _Quantized, batches: list[Tensor], causal: bool) -> _Reference:
    """The full-precision outputs: the transformed copy with every quantizer off."""
    ref = _Reference(causal)
    with _enabled(q, set()), torch.no_grad():
        for batch in batches:
            ref.add(primary_output(run_model(q.model, batch)))
    return ref


@contextmanager
def _enabled(q: _Quantized, sites: set[str]) -> Iterator[None]:
    q.enable(sites)
    try:
        yield
    finally:
        q.enable(set(q.quantizers))


class _Reference:
    """Full-precision outputs per batch and the end-to-end measure of a run against them.

    Causal LMs keep, per batch, the reference probabilities p and Σ_v p·log p per row, so a run
    costs one log-sum-exp and one dot product per row: Σ_v p(log p − log q) with
    log q = x − lse(x) is Σ p·log p − Σ p·x + lse(x)·Σ p, all in float64 (the same value as the
    float64 `log_softmax` form to rounding, at a sixth of its time: torch's float64
    `log_softmax` is not vectorized on CPUs).
    """

    def __init__(self, causal: bool):
        self.causal = causal
        self.outputs: list[Tensor] = []
        self.terms: list[tuple[Tensor, Tensor]] = []  # causal: (Σ p·log p, Σ p) per row
        self.signal = 0.0
        self.tokens = 0

    def add(self, out: Tensor) -> None:
        out = out.detach().double()
        if self.causal:
            out = out.reshape(-1, out.shape[-1])
            logp = out - torch.logsumexp(out, dim=-1, keepdim=True)
            out = logp.exp()
            self.terms.append((torch.linalg.vecdot(out, logp), out.sum(-1)))
        else:
            self.signal += float((out**2).sum())
        self.tokens += out.numel() // out.shape[-1]
        self.outputs.append(out)

    def compare(self, index: int, out: Tensor) -> tuple[float, float]:
        """(sum of per-token KL or of squared error, sum of token cosines) for one batch."""
        ref = self.outputs[index]
        if self.causal:
            plogp, psum = self.terms[index]
            x = out.detach().reshape(-1, out.shape[-1])
            fast = fastpath.lse_dot(x, ref)  # one pass in float64, no float64 copy of x
            if fast is None:
                x = x.double()
                fast = torch.logsumexp(x, dim=-1), (ref.unsqueeze(1) @ x.unsqueeze(-1)).reshape(-1)
            lse, dot = fast
            kl = plogp - dot + lse * psum
            return float(kl.sum()), math.nan
        out = out.detach().double()
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
              seed: int, progress: bool | None = False) -> dict[str, float]:
    """Σ over batches and draws of (g·Δ)² per site (see the module docstring), normalized."""
    model = q.model
    params = [p for p in model.parameters() if p.is_floating_point()]
    flags = [p.requires_grad for p in params]
    sums = dict.fromkeys(q.quantizers, 0.0)
    weights: dict[str, tuple[Tensor, Tensor]] = {}
    modules = dict(model.named_modules())
    for name, by_point in q.quantizers.items():
        if "weight" in by_point:  # an experts site is a parameter of its experts module
            site = q.program.sites[name]
            w = getattr(modules[site.module_name], site.param or "weight")
            weights[name] = (w, (by_point["weight"].quantized_copy(w) - w.detach()))
    gen: torch.Generator | None = None  # on the outputs' device (the model's): one stream
    captured: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}

    def grab(site: str, point: str):
        def hook(module: nn.Module, args: tuple, out: Tensor) -> None:
            captured[site, point] = (out, module.quantized_copy(out) - out.detach())
        return hook

    # every activation a site quantizes: a Linear's input, an attention's query/key/value/probs
    handles = [module.register_forward_hook(grab(name, point))
               for name, by_point in q.quantizers.items()
               for point, module in by_point.items() if point != "weight"]
    q.enable(set())
    try:
        for p in params:
            p.requires_grad_(True)
        for batch in Progress(batches, desc="sensitivity estimate", unit="batch", enabled=progress):
            captured.clear()
            out = primary_output(run_model(model, batch)).float()
            if gen is None:
                gen = torch.Generator(out.device).manual_seed(seed)
            for d in range(draws):
                if ref.causal:
                    with torch.no_grad():
                        probs = torch.softmax(out.detach().reshape(-1, out.shape[-1]).double(), -1)
                        labels = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                    objective = torch.nn.functional.cross_entropy(
                        out.reshape(-1, out.shape[-1]), labels, reduction="sum")
                else:
                    z = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
                    objective = (out * z).sum()
                pairs = [(n, *weights[n]) for n in weights] + [(n, *captured[n, p]) for n, p in captured]
                grads = torch.autograd.grad(objective, [t for _, t, _ in pairs],
                                            retain_graph=d < draws - 1, allow_unused=True)
                dots = dict.fromkeys(q.quantizers, 0.0)  # a site's points add to first order
                for (n, _, delta), g in zip(pairs, grads, strict=True):
                    if g is not None:
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
def site_sensitivity(model: nn.Module, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *,
                     tokenizer: PreTrainedTokenizerBase | None = None, method: str = "exact", activations: bool = False,
                     draws: int = 4, seed: int = 0, batch_size: int = 8, max_length: int = 128,
                     progress: bool | None = False, rotation: str | Rotation | None = None) -> SensitivityReport:
    """Rank the policy's quantized sites by what quantizing each alone does to the model's output
    (see the module docstring for the measures). `method`: exact (one run per site), estimate
    (one forward and `draws` backward passes per batch for all sites) or both (then
    `meta.spearman` records their agreement). `activations`: W4A4, each site's input quantized
    too, for a format name and a policy alike (`setup.scan_policy`). `progress`: see
    `core.progress`. `rotation` (e.g. "hadamard-32", `scan.remedy.Rotation`): each site is
    measured exactly again with that rotation on it (a `rotate` rule for every site it fits),
    into `SensitivityRow.rotated`: the end-to-end gain of the remedy, site by site. `model` is
    left as it was."""
    if method not in METHODS:
        raise UserError(f"method {method!r}: use one of {', '.join(METHODS)}")
    if draws < 1:
        raise UserError("draws must be at least 1")
    rot = Rotation.parse(rotation) if isinstance(rotation, str) else rotation
    if rot is not None and method == "estimate":
        raise UserError("the rotated measure is exact: use method 'exact' or 'both' with a rotation")
    spec = CalibrationSpec.of(calib, tokenizer, batch_size, max_length)
    with eval_mode(model):
        setup = prepare_scan(model, policy_or_format, spec, instrument=False, activations=activations)
        policy, batches, causal = setup.policy, setup.batches, setup.causal
        q = _quantized(setup)
        ref = _reference(q, batches, causal)
        sites = q.program.sites
        rows = []
        for name, by_point in q.quantizers.items():
            fq = next(iter(by_point.values()))  # an attention site's: its KV quantizers, one unit
            shape = sites[name].weight_shape
            rows.append(SensitivityRow(name, sites[name].layer, sites[name].role, math.prod(shape) if shape else 0,
                                       fq.config.name, fq.config.options(), sorted(by_point)))
        meta: dict[str, Any] = {}
        if method in ("exact", "both"):
            start = time.perf_counter()
            for row in Progress(rows, desc="sensitivity", unit="site", enabled=progress):
                with _enabled(q, {row.site}):
                    row.exact, row.extra = _run(q.model, batches, ref)
            meta["exact_seconds_per_site"] = (time.perf_counter() - start) / len(rows)
        if method in ("estimate", "both"):
            start = time.perf_counter()
            est = _estimate(q, batches, ref, draws, seed, progress)
            meta["estimate_seconds"] = time.perf_counter() - start
            for row in rows:
                row.estimate = est[row.site]
        if rot is not None:
            start = time.perf_counter()
            _rotated_runs(setup, sites, rot, rows, ref, progress)
            meta["rotation"] = rot.label
            meta["rotated_seconds_per_site"] = (time.perf_counter() - start) / len(rows)
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
        "calibration": setup.calibration_meta(tokens=ref.tokens),
        "spearman": spearman([r.exact for r in rows], [r.estimate for r in rows])
        if method == "both" else None,
        **meta, "qtransform_version": VERSION,
    }
    return SensitivityReport(meta, rows)


def _rotated_runs(setup: ScanSetup, sites: dict[str, Any], rotation: Rotation,
                  rows: list[SensitivityRow], ref: _Reference, progress: bool | None) -> None:
    """`row.rotated` of every site the rotation fits: the policy plus a `rotate` rule on those
    sites (the rotate pass; full precision unchanged, so `ref` still holds), one exact run per
    site with only its quantizers on, over the same batches."""
    fits = [r.site for r in rows if sites[r.site].weight_shape
            and rotation.block_for(sites[r.site].weight_shape[sites[r.site].reduction_axis])]
    if not fits:
        return
    data = dump_policy(setup.policy)
    data["rotate"] = [*data.get("rotate", []), rotation.rule(fits)]
    q = _quantized(prepare_scan(setup.model, data, setup.calibration, instrument=False))
    for row in Progress([r for r in rows if r.site in fits], desc=f"sensitivity with {rotation.label}",
                        unit="site", enabled=progress):
        with _enabled(q, {row.site}):
            row.rotated = _run(q.model, setup.batches, ref)[0]


def measure_policy(model: nn.Module, policy: PolicyLike, calib: Calibration | CalibrationSpec, *, tokenizer: PreTrainedTokenizerBase | None = None,
                   batch_size: int = 8, max_length: int = 128) -> float:
    """The end-to-end measure (mean KL per token, or output nsr) of a whole policy at once: what
    a budgeted policy's prediction (the sum of its quantized sites' sensitivities) is checked by."""
    spec = CalibrationSpec.of(calib, tokenizer, batch_size, max_length)
    with eval_mode(model):
        setup = prepare_scan(model, policy, spec, instrument=False)
        q = _quantized(setup)
        return _run(q.model, setup.batches, _reference(q, setup.batches, setup.causal))[0]
