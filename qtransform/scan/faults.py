"""Fault-diagnosis scans from the SRDD field notes: gain, kurtosis and instability.

Each answers a narrower question than the activation scan and is read next to it (docs/metrics.md):
does a site swallow small input changes (gain), does quantization clip the tails of its output
distribution (kurtosis), how much does stochastic rounding make its output vary (instability).
Each returns a `ScanReport` whose rows carry `ErrorStats` metrics plus the scan's own keys.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.calibration import Calibration, calibration_batches, run_model
from qtransform.core.metrics import ErrorStats
from qtransform.errors import UserError
from qtransform.passes.instrument import tapping
from qtransform.scan.activations import (
    ForwardHooks,
    SitePairs,
    build_report,
    eval_mode,
    progress_bar,
    resolve_policy,
    site_quantizer,
    site_row,
    transform_for_scan,
)
from qtransform.scan.report import ScanReport
from qtransform.schemas import Policy, dump_policy, load_policy


class GainProbe(ForwardHooks):
    """Local gain: perturb a site's input by a small Gaussian d (`eps` times the input RMS) and
    compare the responses f(x + d) - f(x) of the full-precision and the quantized site, both on
    the full-precision model's input x, so the result isolates the site's own quantization.

    gain = ||response|| / ||d||. A quantizer that swallows small changes (deadzone) gives
    gain_q < gain_fp; one whose rounding steps the perturbation crosses gives gain_q > gain_fp;
    an unquantized site gives exactly the same response, so the ratio is exactly 1.
    """

    def __init__(self, fp: nn.Module, quant: nn.Module, sites: list[str], eps: float, seed: int):
        super().__init__()
        self.eps = eps
        self.stats = {s: ErrorStats() for s in sites}  # full-precision vs quantized response
        self.perturbation = dict.fromkeys(sites, 0.0)  # sum of |d|^2
        for site in sites:
            seed_site = seed * 1_000_003 + zlib.crc32(site.encode())
            self.add(fp.get_submodule(site), self._probe(site, quant.get_submodule(site), seed_site))

    def _probe(self, site: str, qmod: nn.Module, seed: int) -> Callable:
        gen: list[torch.Generator] = []

        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            x = args[0]
            if not gen or gen[0].device != x.device:
                gen[:] = [torch.Generator(device=x.device).manual_seed(seed)]
            z = torch.randn(x.shape, generator=gen[0], device=x.device)
            xp = x + (self.eps * x.float().pow(2).mean().sqrt() * z).to(x.dtype)
            d = xp.double() - x.double()  # the perturbation as the dtype represents it
            self.perturbation[site] += float(d.pow(2).sum())
            self.stats[site].update(module.forward(xp).double() - output.double(),
                                    qmod(xp).double() - qmod(x).double())
        return hook

    def gains(self, site: str) -> dict[str, float]:
        state, d2 = self.stats[site].state(), self.perturbation[site]
        gain_fp = math.sqrt(state["sum_x2"] / d2) if d2 else math.nan
        gain_q = math.sqrt(state["sum_q2"] / d2) if d2 else math.nan
        return {"gain_fp": gain_fp, "gain_q": gain_q,
                "gain_ratio": gain_q / gain_fp if gain_fp else math.nan, "eps": self.eps}


class RunVariance(ForwardHooks):
    """Repeated runs of each batch: per-site error against the full-precision output (every run)
    and the per-element variance across runs (Welford in float64). Only sums outlive a batch."""

    def __init__(self, fp: nn.Module, quant: nn.Module, sites: list[str]):
        super().__init__()
        self.stats = {s: ErrorStats() for s in sites}
        self.sums = {s: [0.0, 0.0, 0] for s in sites}  # sum of variances, of mean^2, elements
        self._fp: dict[str, list[Tensor]] = {s: [] for s in sites}
        self._welford: dict[str, list[list[Tensor]]] = {s: [] for s in sites}
        self._calls = dict.fromkeys(sites, 0)
        self.runs = 0
        for site in sites:
            self.add(fp.get_submodule(site), self._keep(site))
            self.add(quant.get_submodule(site), self._observe(site))

    def _keep(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            self._fp[site].append(output.detach())
        return hook

    def _observe(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            k = self._calls[site]
            self._calls[site] += 1
            self.stats[site].update(self._fp[site][k], output)
            y, states = output.detach().double(), self._welford[site]
            if k == len(states):
                states.append([y.clone(), torch.zeros_like(y)])
                return
            mean, m2 = states[k]
            delta = y - mean
            mean += delta / (self.runs + 1)
            m2 += delta * (y - mean)
        return hook

    def end_run(self) -> None:
        self.runs += 1
        self._calls = dict.fromkeys(self._calls, 0)

    def end_batch(self) -> None:
        for site, states in self._welford.items():
            for mean, m2 in states:
                self.sums[site][0] += float(m2.sum()) / (self.runs - 1)
                self.sums[site][1] += float(mean.pow(2).sum())
                self.sums[site][2] += mean.numel()
            states.clear()
            self._fp[site].clear()
        self.runs = 0

    def variance(self, site: str) -> dict[str, float]:
        var_sum, signal, n = self.sums[site]
        return {"variance": var_sum / n if n else math.nan,
                "rel_std": math.sqrt(var_sum / signal) if signal else math.nan}


def gain_scan(model: nn.Module, policy_or_format: Any, calib: Calibration, *, eps: float = 1e-3,
              seed: int = 0, tokenizer: Any = None, batch_size: int = 8, max_length: int = 128,
              progress: bool | None = False) -> ScanReport:
    """Per-site gain_fp, gain_q and gain_ratio (see `GainProbe`); the row's error metrics compare
    the quantized site's response to the perturbation with the full-precision response."""
    program, policy, sites = transform_for_scan(model, policy_or_format)
    quant = program.module()
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    with eval_mode(model), GainProbe(model, quant, sites, eps, seed) as probe, \
            tapping(quant, False), torch.no_grad():
        for batch in progress_bar(batches, progress, "gain scan"):
            run_model(model, batch)
    rows = [site_row(program.sites[s], "output", probe.stats[s], site_quantizer(program, s),
                 extra=probe.gains(s)) for s in sites]
    return build_report("gain_scan", program, policy, rows, eps=eps, seed=seed)


def kurtosis_scan(model: nn.Module, policy_or_format: Any, calib: Calibration, *,
                  tokenizer: Any = None, batch_size: int = 8, max_length: int = 128,
                  progress: bool | None = False) -> ScanReport:
    """Kurtosis (non-excess: 3 for a Gaussian) of each site's output in the full-precision and
    the quantized model and their ratio; clipping (saturation) flattens tails and lowers it.
    The row's error metrics are the site's accumulated error."""
    program, policy, sites = transform_for_scan(model, policy_or_format)
    quant = program.module()
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    modules = {s: program.sites[s].module_name for s in sites}
    with eval_mode(model), SitePairs(model, quant, sites, modules=modules) as pairs, tapping(quant, False), \
            torch.no_grad():
        for batch in progress_bar(batches, progress, "kurtosis scan"):
            run_model(model, batch)
            run_model(quant, batch)
            pairs.end_batch()
    rows = []
    for name, stats in pairs.stats.items():
        res = stats.result()
        k_fp, k_q = res["kurtosis_orig"], res["kurtosis_quant"]
        extra = {"kurtosis_fp": k_fp, "kurtosis_q": k_q,
                 "kurtosis_ratio": k_q / k_fp if k_fp else math.nan}
        rows.append(site_row(program.sites[name], "output", stats, site_quantizer(program, name),
                             extra=extra))
    return build_report("kurtosis_scan", program, policy, rows)


def stochastic_policy(policy: Policy, seed: int) -> Policy:
    """The same policy with stochastic rounding (seeded) in every quantize rule."""
    data = dump_policy(policy)
    for rule in data["quantize"]:
        rule["rounding"] = "stochastic"
        rule["seed"] = seed if rule.get("seed") is None else rule["seed"]
    return load_policy(data)


def instability_scan(model: nn.Module, policy_or_format: Any, calib: Calibration, *,
                     runs: int = 8, seed: int = 0, tokenizer: Any = None, batch_size: int = 8,
                     max_length: int = 128, progress: bool | None = False) -> ScanReport:
    """Run each batch `runs` times with stochastic rounding: per site, the output variance across
    runs (0 for a deterministic site) and its std relative to the output RMS; the row's error
    metrics compare every run with the full-precision output."""
    if runs < 2:
        raise UserError("instability_scan needs runs >= 2")
    policy = stochastic_policy(resolve_policy(model, policy_or_format), seed)
    program, policy, sites = transform_for_scan(model, policy)
    quant = program.module()
    batches = calibration_batches(calib, tokenizer=tokenizer, batch_size=batch_size,
                                  max_length=max_length, model=model)
    with eval_mode(model), RunVariance(model, quant, sites) as var, tapping(quant, False), \
            torch.no_grad():
        for batch in progress_bar(batches, progress, "instability scan"):
            run_model(model, batch)
            for _ in range(runs):
                run_model(quant, batch)
                var.end_run()
            var.end_batch()
    rows = [site_row(program.sites[s], "output", var.stats[s], site_quantizer(program, s),
                 extra={**var.variance(s), "runs": runs}) for s in sites]
    return build_report("instability_scan", program, policy, rows, runs=runs, seed=seed)
