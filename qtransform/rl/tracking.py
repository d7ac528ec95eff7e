"""What an RL run with a transformed model logs, and writing it to any tracker.

One flat dict of floats under `qtransform/` keys, the same from the TRL callback and from a custom
loop (`rl_metrics` + `log_to`):

- `sigma`: AQN's scheduled sigma of the rollouts the row's rewards come from; `step` and the
  noise controller's counters (`forwards`, `noised_forwards`, `syncs`, `noised_syncs`)
- `mismatch/<key>`: `mismatch_metrics` of the rollout's log-probs against the trainer's
- `weights/<site>/{sqnr_db,saturation,deadzone}` and the worst over sites (`weights/min_sqnr_db`,
  `weights/max_saturation`, `weights/max_deadzone`): fake quantization of the weights as they are
  now, measured with `core.metrics.ErrorStats` (docs/metrics.md), one quantization per weight
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from qtransform.core.metrics import ErrorStats
from qtransform.core.schedule import sigma_at
from qtransform.core.tracing import module_graph
from qtransform.errors import UserError
from qtransform.formats.quantize import quantize_with_info
from qtransform.passes import FakeQuantize, FakeQuantPass
from qtransform.rl.mismatch import mismatch_metrics
from qtransform.rl.noise import NoiseController, noise_controller

PREFIX = "qtransform/"
COUNTERS = ("forwards", "noised_forwards", "syncs", "noised_syncs")
WEIGHT_KEYS = ("sqnr_db", "saturation", "deadzone")


def noise_metrics(noise: NoiseController | None, sigma: float | None = None) -> dict[str, float]:
    """Sigma (the controller's current one unless the rollouts' is given), step and counters."""
    if noise is None or not noise.modules:
        return {}
    report = noise.report()
    if sigma is None:
        sigma = sigma_at(noise.current_step, noise.schedule)
    out = {f"{PREFIX}sigma": float(sigma), f"{PREFIX}step": float(report["step"])}
    out.update((f"{PREFIX}{key}", float(report[key])) for key in COUNTERS)
    return out


def _weight_quantizers(model: nn.Module) -> dict[str, tuple[Tensor, FakeQuantize]]:
    """Site -> (its weight parameter, the fake-quant applied to it)."""
    found = {}
    for module in model.modules():
        state = module_graph(module)
        if state is None:
            continue
        for ins in state.insertions:
            if ins.point != "weight" or ins.pass_name != FakeQuantPass.name:
                continue
            leaf = ins.site.rsplit(".", 1)[-1]
            param = module._parameters.get(leaf)
            if not isinstance(param, nn.Parameter):
                param = module._parameters["weight"]
            found[ins.site] = (param, module._modules[ins.module_path.rsplit(".", 1)[-1]])
    return found


def weight_stats(model: nn.Module) -> dict[str, float]:
    """SQNR (dB), saturation and deadzone of every fake-quantized weight as it is now."""
    out: dict[str, float] = {}
    with torch.no_grad():
        for site, (param, quant) in _weight_quantizers(model).items():
            w = param.detach()
            stats = ErrorStats()
            for part in (w.unbind(0) if quant.per_expert else (w,)):
                q, sat, _ = quantize_with_info(part, quant.config)
                stats.update(part, q, sat)
            result = stats.result()
            out.update((f"{PREFIX}weights/{site}/{key}", float(result[key])) for key in WEIGHT_KEYS)
    if out:
        def worst(key: str, pick: Callable[..., float]) -> float:
            return pick(v for k, v in out.items() if k.endswith(f"/{key}"))
        out[f"{PREFIX}weights/min_sqnr_db"] = worst("sqnr_db", min)
        out[f"{PREFIX}weights/max_saturation"] = worst("saturation", max)
        out[f"{PREFIX}weights/max_deadzone"] = worst("deadzone", max)
    return out


def rl_metrics(model: nn.Module, *, trainer_logp: Tensor | None = None, rollout_logp: Tensor | None = None,
               mask: Tensor | None = None, weights: bool = False) -> dict[str, float]:
    """The `qtransform/` metrics of a custom loop's step: call it after the rollouts (so sigma is
    theirs) with their log-probs and the trainer's, before stepping the noise controller."""
    try:
        out = noise_metrics(noise_controller(model))
    except UserError:  # a policy without noise
        out = {}
    if (trainer_logp is None) != (rollout_logp is None):
        raise UserError("pass both trainer_logp and rollout_logp for the mismatch metrics, or neither")
    if trainer_logp is not None and rollout_logp is not None:
        out.update((f"{PREFIX}mismatch/{k}", v)
                   for k, v in mismatch_metrics(trainer_logp, rollout_logp, mask).items())
    if weights:
        out.update(weight_stats(model))
    return out


def log_to(tracker: object, metrics: dict[str, float], step: int) -> None:
    """Write `metrics` at `step` to a tracker: trackio or wandb (`log(dict, step=)`), a tensorboard
    `SummaryWriter` (`add_scalar`), mlflow (`log_metrics`), or a callable `f(metrics, step)`."""
    if hasattr(tracker, "add_scalar"):
        for key, value in metrics.items():
            tracker.add_scalar(key, value, step)
    elif hasattr(tracker, "log_metrics"):
        tracker.log_metrics(metrics, step=step)
    elif hasattr(tracker, "log"):
        tracker.log(metrics, step=step)
    elif callable(tracker):
        tracker(metrics, step)
    else:
        raise UserError(f"log_to cannot write to a {type(tracker).__name__}: pass a trackio or wandb "
                        "run, a tensorboard SummaryWriter, mlflow, or a function f(metrics, step)")
