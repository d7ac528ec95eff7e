"""Off-policy corrections for rollouts sampled from a different policy than the one trained
(quantized, AQN-noised rollouts scored against the trainer's noise-free forward).

Everything works on the sampled tokens' log-probs, [batch, tokens], with r = trainer - rollout
per token, and returns per-token factors for the policy loss (0 on padding), detached: the
weights change the measure, not the objective. Names and semantics follow verl's rollout
correction (verl/trainer/ppo/rollout_corr_helper.py, verl/docs/algo/rollout_corr.md, Jan 2026):

- `importance_weights`: `level` "token" (exp r per token), "sequence" (exp Σ r, one weight per
  sequence, verl's rollout_is="sequence") or "geometric" (exp of the sequence's mean r); log-ratios
  clamped to ±20 before exp as in verl. `mode` "truncate" clamps above `threshold` (TIS, verl's
  rollout_is_threshold; `lower` clamps below too, like TRL's clip_min) or "mask" zeroes weights
  outside [lower, threshold] (MIS, TRL's *_mask modes).
- `icepop_mask`: IcePop's token mask, 1 where the token's ratio exp r lies in [low, high].
- `rejection_mask`: verl's rollout_rs options ("token_k1", "seq_sum_k1", "seq_mean_k3", ...,
  comma separated, all must pass) with verl's thresholds: k1 options bound the ratio
  π_rollout / π_trainer (verl's statistic is -r) by "lower_upper" (one number u means 1/u_u);
  k2 (r²/2) and k3 (exp r - 1 - r) options take an upper bound. A token or a whole sequence
  outside the bounds gets 0.
- `Correction` bundles the three as one configuration, with the same names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qtransform.errors import UserError
from qtransform.rl.mismatch import SAFETY_BOUND

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _prepared(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """r = trainer - rollout (0 on padding) and the float mask."""
    if trainer_logp.dim() != 2 or trainer_logp.shape != rollout_logp.shape:
        raise UserError(f"corrections need two [batch, tokens] log-prob tensors of one shape, got "
                        f"{tuple(trainer_logp.shape)} and {tuple(rollout_logp.shape)}")
    if mask is None:
        mask = torch.ones_like(trainer_logp)
    if mask.shape != trainer_logp.shape:
        raise UserError(f"the mask's shape {tuple(mask.shape)} is not the log-probs' "
                        f"{tuple(trainer_logp.shape)}: pass one 0/1 entry per token")
    weight = mask.to(device=trainer_logp.device, dtype=trainer_logp.dtype)
    r = (trainer_logp.detach() - rollout_logp.detach()).masked_fill(weight == 0, 0.0)
    return r, weight


def _sequence_log_ratio(r: Tensor, weight: Tensor, level: str) -> Tensor:
    """Per-token log-weights: r itself, or the sequence's sum or mean broadcast over its tokens."""
    if level == "token":
        return r
    total = r.sum(dim=-1, keepdim=True)
    if level == "geometric":
        total = total / weight.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return total.expand_as(r)


def importance_weights(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None, *,
                       level: str = "token", mode: str = "truncate", threshold: float = 2.0,
                       lower: float | None = None) -> Tensor:
    """π_trainer / π_rollout per token, sequence or geometric mean, truncated or masked."""
    _check_is(level, mode, threshold, lower)
    r, weight = _prepared(trainer_logp, rollout_logp, mask)
    w = torch.exp(_sequence_log_ratio(r, weight, level).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if mode == "truncate":
        w = w.clamp(min=lower, max=threshold)
    else:
        w = w.masked_fill((w > threshold) | (w < (lower or 0.0)), 0.0)
    return w * weight


def icepop_mask(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None, *,
                low: float = 0.5, high: float = 2.0) -> Tensor:
    """1 for tokens whose ratio π_trainer / π_rollout is within [low, high], else 0 (IcePop)."""
    if not 0 < low <= 1 <= high:
        raise UserError(f"IcePop bounds must satisfy 0 < low <= 1 <= high, got [{low}, {high}]")
    r, weight = _prepared(trainer_logp, rollout_logp, mask)
    keep = (r >= math.log(low)) & (r <= math.log(high))
    return keep.to(weight.dtype) * weight


def _thresholds(options: list[str], spec: float | str) -> list[tuple[float | None, float]]:
    """verl's rollout_rs_threshold: one entry per option (or one for all); k1 takes "lower_upper"."""
    parts = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise UserError(f"rollout_rs_threshold {spec!r} has {len(parts)} entries for {len(options)} "
                        "rollout_rs options: give one for all or one per option")
    out: list[tuple[float | None, float]] = []
    for option, part in zip(options, parts, strict=True):
        try:
            bounds = [float(x) for x in part.split("_")]
        except ValueError:
            raise UserError(f"rollout_rs_threshold entry {part!r} is not a number or 'lower_upper'") from None
        if option.endswith("k1"):
            low, high = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
            if len(bounds) > 2 or not 0 < low <= high:
                raise UserError(f"{option} needs 'lower_upper' ratio bounds with 0 < lower <= upper, got {part!r}")
            out.append((low, high))
        else:
            if len(bounds) != 1 or bounds[0] <= 0:
                raise UserError(f"{option} needs one positive upper bound, got {part!r}")
            out.append((None, bounds[0]))
    return out


def _rs_options(rollout_rs: str) -> list[str]:
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise UserError(f"unknown rollout_rs option(s) {unknown or [rollout_rs]}: use "
                        f"{', '.join(RS_OPTIONS)} (comma separated)")
    return options


def rejection_mask(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None, *,
                   rollout_rs: str = "seq_sum_k1", threshold: float | str = 2.0) -> Tensor:
    """1 for the tokens kept by every verl rejection option in `rollout_rs`, else 0."""
    options = _rs_options(rollout_rs)
    bounds = _thresholds(options, threshold)
    r, weight = _prepared(trainer_logp, rollout_logp, mask)
    safe = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.expm1(safe) - safe}
    keep = torch.ones_like(weight, dtype=torch.bool)
    count = weight.sum(dim=-1, keepdim=True).clamp_min(1.0)
    for option, (low, high) in zip(options, bounds, strict=True):
        value = stats[option[-2:]] * weight
        if option.startswith("seq_sum"):
            value = value.sum(dim=-1, keepdim=True)
        elif option.startswith("seq_mean"):
            value = value.sum(dim=-1, keepdim=True) / count
        elif option.startswith("seq_max"):
            value = value.masked_fill(weight == 0, 0.0).amax(dim=-1, keepdim=True)
        if low is not None:  # k1: bounds on exp(-r) = π_rollout / π_trainer, compared in log space
            keep &= (value >= math.log(low)) & (value <= math.log(high))
        else:
            keep &= value <= high
    return keep.to(weight.dtype) * weight


def _check_is(level: str, mode: str, threshold: float, lower: float | None) -> None:
    if level not in LEVELS:
        raise UserError(f"unknown importance-weight level {level!r}: use {', '.join(LEVELS)}")
    if mode not in MODES:
        raise UserError(f"unknown importance-weight mode {mode!r}: use truncate (TIS) or mask (MIS)")
    if threshold <= 0 or (lower is not None and not 0 <= lower <= threshold):
        raise UserError(f"importance-weight bounds need 0 <= lower <= threshold and threshold > 0, "
                        f"got lower={lower}, threshold={threshold}")


@dataclass(frozen=True)
class Correction:
    """One rollout correction: importance weights, IcePop bounds and rejection, each optional.

    `rollout_is` is the weight level (None: no weights), `rollout_is_threshold` / `rollout_is_lower`
    its bounds and `rollout_is_mode` truncate (TIS) or mask (MIS); `icepop` (low, high) masks
    tokens; `rollout_rs` / `rollout_rs_threshold` reject tokens or sequences as verl does."""

    rollout_is: str | None = "token"
    rollout_is_threshold: float = 2.0
    rollout_is_mode: str = "truncate"
    rollout_is_lower: float | None = None
    icepop: tuple[float, float] | None = None
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None

    def __post_init__(self) -> None:
        if self.rollout_is is not None:
            _check_is(self.rollout_is, self.rollout_is_mode, self.rollout_is_threshold,
                      self.rollout_is_lower)
        if self.icepop is not None and not 0 < self.icepop[0] <= 1 <= self.icepop[1]:
            raise UserError(f"IcePop bounds must satisfy 0 < low <= 1 <= high, got {self.icepop}")
        if self.rollout_rs is not None:
            if self.rollout_rs_threshold is None:
                raise UserError("rollout_rs needs rollout_rs_threshold (verl has no default either)")
            _thresholds(_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if self.rollout_is is None and self.icepop is None and self.rollout_rs is None:
            raise UserError("this Correction corrects nothing: set rollout_is, icepop or rollout_rs")

    def weights(self, trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor | None = None) -> Tensor:
        """The per-token factor for the policy loss: weights × IcePop mask × rejection mask."""
        _, out = _prepared(trainer_logp, rollout_logp, mask)
        if self.rollout_is is not None:
            out = out * importance_weights(trainer_logp, rollout_logp, mask, level=self.rollout_is,
                                           mode=self.rollout_is_mode, threshold=self.rollout_is_threshold,
                                           lower=self.rollout_is_lower)
        if self.icepop is not None:
            out = out * icepop_mask(trainer_logp, rollout_logp, mask, low=self.icepop[0], high=self.icepop[1])
        if self.rollout_rs is not None:
            out = out * rejection_mask(trainer_logp, rollout_logp, mask, rollout_rs=self.rollout_rs,
                                       threshold=self.rollout_rs_threshold)
        return out

    def to_verl(self) -> dict[str, Any]:
        """The verl config overrides that apply this correction (keys read in verl's
        `algorithm/rollout_correction.yaml` and `RolloutConfig.calculate_log_probs`, Jan 2026).

        verl truncates weights above only and has no geometric weight level, so a masked, lower-
        clamped or geometric `rollout_is` is refused; IcePop becomes verl's `token_k1` rejection,
        whose bounds are on π_rollout / π_trainer: [1/high, 1/low]."""
        if self.rollout_is == "geometric" or self.rollout_is_mode != "truncate" or self.rollout_is_lower:
            raise UserError("verl's rollout_is is token or sequence, truncated above only: for a "
                            "geometric filter use rollout_rs='seq_mean_k1', for masking a rollout_rs option")
        options = _rs_options(self.rollout_rs) if self.rollout_rs else []
        bounds = [_verl_bound(b) for b in _thresholds(options, self.rollout_rs_threshold)] if options else []
        if self.icepop is not None:
            low, high = self.icepop
            options, bounds = [*options, "token_k1"], [*bounds, f"{1 / high:g}_{1 / low:g}"]
        section: dict[str, Any] = {
            "rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold,
            "rollout_is_batch_normalize": False,
            "rollout_rs": ",".join(options) or None, "rollout_rs_threshold": ",".join(bounds) or None,
            "bypass_mode": False,
        }
        return {"algorithm": {"rollout_correction": section},
                "actor_rollout_ref": {"rollout": {"calculate_log_probs": True}}}


def _verl_bound(bound: tuple[float | None, float]) -> str:
    low, high = bound
    return f"{high:g}" if low is None else f"{low:g}_{high:g}"
