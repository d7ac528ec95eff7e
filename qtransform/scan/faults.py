"""Fault-diagnosis scans from the SRDD field notes: gain, kurtosis and instability.

Each answers a narrower question than the activation scan and is read next to it (docs/metrics.md):
does a site swallow small input changes (gain), does quantization clip the tails of its output
distribution (kurtosis), how much does stochastic rounding make its output vary (instability).
Each returns a `ScanReport` whose rows carry `ErrorStats` metrics plus the scan's own keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from qtransform.calibration import Calibration, run_model
from qtransform.core.metrics import ErrorStats
from qtransform.core.progress import Progress
from qtransform.core.sites import ATTENTION_KIND
from qtransform.core.streams import DrawStream
from qtransform.errors import UserError
from qtransform.passes.instrument import tapping
from qtransform.scan.measure import ForwardHooks, SitePairs, build_report, site_quantizer, site_row
from qtransform.scan.report import ScanReport
from qtransform.scan.setup import CalibrationSpec, eval_mode, prepare_scan, resolve_policy
from qtransform.schemas import Policy, dump_policy, load_policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qtransform.schemas import PolicyLike


def _main(output: Tensor | tuple) -> Tensor:
    """A router's (logits, scores, indices): its logits; any other site's output as it is."""
    return output[0] if isinstance(output, tuple) else output


class GainProbe(ForwardHooks):
    """Local gain: perturb a site's input by a small Gaussian d (`eps` times the input RMS) and
    compare the responses f(x + d) - f(x) of the full-precision and the quantized site, both on
    the full-precision model's input x, so the result isolates the site's own quantization.

    gain = ||response|| / ||d||. A quantizer that swallows small changes (deadzone) gives
    gain_q < gain_fp; one whose rounding steps the perturbation crosses gives gain_q > gain_fp;
    an unquantized site gives exactly the same response, so the ratio is exactly 1.

    Keyed by measured module (`ScanSetup.site_modules`: an experts site is
    measured at its experts module, both of its matmuls in one call): an experts module gets its hidden states
    perturbed while its routing arguments (expert ids, weights) stay as the full-precision model
    chose them, so the gain is that of the experts themselves, not of a routing change.
    """

    def __init__(self, fp: nn.Module, quant: nn.Module, paths: list[str], eps: float, seed: int):
        super().__init__()
        self.eps = eps
        self.stats = {p: ErrorStats() for p in paths}  # full-precision vs quantized response
        self.perturbation = dict.fromkeys(paths, 0.0)  # sum of |d|^2
        with self.registering():
            for path in paths:  # one stream per site (`core.streams`), one draw per call
                stream = DrawStream(seed, f"{path}/gain_probe")
                self.add(fp.get_submodule(path), self._probe(path, quant.get_submodule(path), stream))

    def _probe(self, path: str, qmod: nn.Module, stream: DrawStream) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            x, rest = args[0], args[1:]  # rest: an experts module's routing, kept as it is
            gen = stream.generator(x.device, stream.next_index())
            z = torch.randn(x.shape, generator=gen, device=x.device)
            xp = x + (self.eps * x.float().pow(2).mean().sqrt() * z).to(x.dtype)
            d = xp.double() - x.double()  # the perturbation as the dtype represents it
            self.perturbation[path] += float(d.pow(2).sum())
            self.stats[path].update(_main(module.forward(xp, *rest)).double() - _main(output).double(),
                                    _main(qmod(xp, *rest)).double() - _main(qmod(x, *rest)).double())
        return hook

    def gains(self, path: str) -> dict[str, float]:
        state, d2 = self.stats[path].state(), self.perturbation[path]
        gain_fp = math.sqrt(state["sum_x2"] / d2) if d2 else math.nan
        gain_q = math.sqrt(state["sum_q2"] / d2) if d2 else math.nan
        return {"gain_fp": gain_fp, "gain_q": gain_q,
                "gain_ratio": gain_q / gain_fp if gain_fp else math.nan, "eps": self.eps}


class RunVariance(ForwardHooks):
    """Repeated runs of each batch: per-site error against the full-precision output (every run)
    and the per-element variance across runs (Welford in float64). Only sums outlive a batch.
    Keyed by measured module (`ScanSetup.site_modules`: an experts site is
    measured at its experts module, both of its matmuls in one call)."""

    def __init__(self, fp: nn.Module, quant: nn.Module, paths: list[str]):
        super().__init__()
        self.stats = {p: ErrorStats() for p in paths}
        self.sums = {p: [0.0, 0.0, 0] for p in paths}  # sum of variances, of mean^2, elements
        self._fp: dict[str, list[Tensor]] = {p: [] for p in paths}
        self._welford: dict[str, list[list[Tensor]]] = {p: [] for p in paths}
        self._calls = dict.fromkeys(paths, 0)
        self.runs = 0
        with self.registering():
            for path in paths:
                self.add(fp.get_submodule(path), self._keep(path))
                self.add(quant.get_submodule(path), self._observe(path))

    def _keep(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            self._fp[site].append(_main(output).detach())
        return hook

    def _observe(self, site: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor | tuple) -> None:
            k = self._calls[site]
            self._calls[site] += 1
            self.stats[site].update(self._fp[site][k], _main(output))
            y, states = _main(output).detach().double(), self._welford[site]
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


def gain_scan(model: nn.Module, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *, eps: float = 1e-3,
              seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8, max_length: int = 128,
              progress: bool | None = False) -> ScanReport:
    """Per-site gain_fp, gain_q and gain_ratio (see `GainProbe`); the row's error metrics compare
    the quantized site's response to the perturbation with the full-precision response."""
    setup = prepare_scan(model, policy_or_format, CalibrationSpec.of(calib, tokenizer, batch_size, max_length))
    program, quant = setup.program, setup.quant
    # an attention module is called with keyword arguments only: no input to perturb here
    at = {s: m for s, m in setup.site_modules().items() if program.sites[s].kind != ATTENTION_KIND}
    with eval_mode(model), GainProbe(model, quant, list(dict.fromkeys(at.values())), eps, seed) as probe, \
            tapping(quant, False), torch.no_grad():
        for batch in Progress(setup.batches, desc="gain scan", unit="batch", enabled=progress):
            run_model(model, batch)
    rows = [site_row(program.sites[s], "output", probe.stats[at[s]], site_quantizer(program, s),
                     extra=probe.gains(at[s])) for s in at]
    return build_report("gain_scan", program, setup.policy, rows, eps=eps, seed=seed)


def kurtosis_scan(model: nn.Module, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *,
                  tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8, max_length: int = 128,
                  progress: bool | None = False) -> ScanReport:
    """Kurtosis (non-excess: 3 for a Gaussian) of each site's output in the full-precision and
    the quantized model and their ratio; clipping (saturation) flattens tails and lowers it.
    The row's error metrics are the site's accumulated error."""
    setup = prepare_scan(model, policy_or_format, CalibrationSpec.of(calib, tokenizer, batch_size, max_length))
    program, quant = setup.program, setup.quant
    with eval_mode(model), SitePairs(model, quant, setup.sites, modules=setup.site_modules()) as pairs, \
            tapping(quant, False), torch.no_grad():
        for batch in Progress(setup.batches, desc="kurtosis scan", unit="batch", enabled=progress):
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
    return build_report("kurtosis_scan", program, setup.policy, rows)


def stochastic_policy(policy: Policy, seed: int) -> Policy:
    """The same policy with stochastic rounding (seeded) in every quantize rule."""
    data = dump_policy(policy)
    for rule in data["quantize"]:
        rule["rounding"] = "stochastic"
        rule["seed"] = seed if rule.get("seed") is None else rule["seed"]
    return load_policy(data)


def instability_scan(model: nn.Module, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *,
                     runs: int = 8, seed: int = 0, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8,
                     max_length: int = 128, progress: bool | None = False) -> ScanReport:
    """Run each batch `runs` times with stochastic rounding: per site, the output variance across
    runs (0 for a deterministic site) and its std relative to the output RMS; the row's error
    metrics compare every run with the full-precision output."""
    if runs < 2:
        raise UserError("instability_scan needs runs >= 2")
    policy = stochastic_policy(resolve_policy(model, policy_or_format), seed)
    setup = prepare_scan(model, policy, CalibrationSpec.of(calib, tokenizer, batch_size, max_length))
    program, quant, at = setup.program, setup.quant, setup.site_modules()
    with eval_mode(model), RunVariance(model, quant, list(dict.fromkeys(at.values()))) as var, \
            tapping(quant, False), torch.no_grad():
        for batch in Progress(setup.batches, desc="instability scan", unit="batch", enabled=progress):
            run_model(model, batch)
            for _ in range(runs):
                run_model(quant, batch)
                var.end_run()
            var.end_batch()
    rows = [site_row(program.sites[s], "output", var.stats[at[s]], site_quantizer(program, s),
                     extra={**var.variance(at[s]), "runs": runs}) for s in setup.sites]
    return build_report("instability_scan", program, setup.policy, rows, runs=runs, seed=seed)
