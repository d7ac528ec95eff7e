"""Rollout/trainer mismatch metrics: the one home of the formulas, under verl's names.

Inputs are the log-probs of the sampled tokens, [batch, tokens]: `trainer_logp` from the policy
being trained, `rollout_logp` from the sampler that generated the tokens; `mask` marks real tokens
(1) against padding (0). With r = trainer - rollout per token, the keys are verl's `rollout_corr/*`
(`compute_offpolicy_metrics` in verl/trainer/ppo/rollout_corr_helper.py, read Jan 2026) without
the prefix:

- kl = mean over tokens of (rollout - trainer): KL(rollout || trainer), k1 estimator
- k3_kl = mean over tokens of exp(r) - r - 1 (Schulman's k3, >= 0)
- training_ppl, rollout_ppl = mean over sequences of exp(-(the sequence's mean log-prob))
- log_ppl_diff = mean over sequences of (rollout mean log-prob - trainer mean log-prob);
  log_ppl_abs_diff the same of its absolute value; ppl_ratio = mean of exp(log_ppl_diff)
- chi2_token = mean over tokens of exp(clamp(r, ±20))² - 1
- chi2_seq = mean over sequences of exp(2 clamp(Σ r, ±20)) - 1

and two that verl logs for its weights in another form:

- ess = (Σ w)² / (n Σ w²) over the n sequences' importance weights w = exp(clamp(Σ r, ±20)):
  the effective sample size as a fraction of the batch, 1 when every weight is equal
- ratio_p05, ratio_p50, ratio_p95: quantiles of the token importance ratios exp(r)

Everything is computed in float64. Two deliberate differences from verl: sequences without a
single real token are left out of the sequence means (verl counts them as zeros), and means
divide by the exact count (verl adds 1e-8 to it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qtransform.errors import UserError

SAFETY_BOUND = 20.0  # verl's clamp on log-ratios before exponentiating (exp(20) ~ 4.9e8)
KEYS = ("kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff",
        "ppl_ratio", "chi2_token", "chi2_seq", "ess", "ratio_p05", "ratio_p50", "ratio_p95")


def _checked(trainer_logp: Tensor, rollout_logp: Tensor,
             mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if trainer_logp.dim() != 2 or trainer_logp.shape != rollout_logp.shape:
        raise UserError(f"mismatch_metrics needs two [batch, tokens] log-prob tensors of one shape, "
                        f"got {tuple(trainer_logp.shape)} and {tuple(rollout_logp.shape)}")
    if mask is None:
        mask = torch.ones_like(trainer_logp, dtype=torch.bool)
    if mask.shape != trainer_logp.shape:
        raise UserError(f"the mask's shape {tuple(mask.shape)} is not the log-probs' "
                        f"{tuple(trainer_logp.shape)}: pass one 0/1 entry per token")
    mask = mask.to(device=trainer_logp.device).bool()
    if not mask.any():
        raise UserError("the mask marks no real token: nothing to compare")
    return trainer_logp.detach().double(), rollout_logp.detach().double(), mask


def mismatch_metrics(trainer_logp: Tensor, rollout_logp: Tensor,
                     mask: Tensor | None = None) -> dict[str, float]:
    """verl's rollout_corr metrics (plus ess and ratio quantiles) of one batch, as floats.

    The tokens are sampled from the rollout policy, so every expectation is over rollout samples.
    """
    train, roll, mask = _checked(trainer_logp, rollout_logp, mask)
    weight = mask.double()
    tokens = weight.sum()
    rows = mask.any(dim=-1)  # sequences with at least one real token
    per_row = weight.sum(dim=-1).clamp_min(1.0)

    def token_mean(values: Tensor) -> float:
        return float((values * weight).sum() / tokens)

    def row_sum(values: Tensor) -> Tensor:
        return (values * weight).sum(dim=-1)[rows]

    r = (train - roll).masked_fill(~mask, 0.0)
    mean_train = row_sum(train) / per_row[rows]
    mean_roll = row_sum(roll) / per_row[rows]
    log_ppl_diff = mean_roll - mean_train
    log_seq = row_sum(r).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_weights = torch.exp(log_seq - log_seq.max())  # ess is scale-free: no overflow
    ratios = torch.exp(r[mask].clamp(-SAFETY_BOUND, SAFETY_BOUND))
    p05, p50, p95 = torch.quantile(ratios, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64,
                                                       device=ratios.device)).tolist()
    return {
        "kl": token_mean(-r),
        "k3_kl": token_mean(torch.expm1(r) - r),
        "training_ppl": float(torch.exp(-mean_train).mean()),
        "rollout_ppl": float(torch.exp(-mean_roll).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": token_mean(torch.expm1(2.0 * r.clamp(-SAFETY_BOUND, SAFETY_BOUND))),
        "chi2_seq": float(torch.expm1(2.0 * log_seq).mean()),
        "ess": float(seq_weights.sum() ** 2 / (seq_weights.numel() * (seq_weights ** 2).sum())),
        "ratio_p05": p05, "ratio_p50": p50, "ratio_p95": p95,
    }
