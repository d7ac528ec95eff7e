"""Mismatch metrics: verl's rollout_corr formulas checked against values computed by hand on small
batches (padding and an all-padding row included), and properties over random batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.errors import UserError
from qtransform.rl import mismatch_metrics
from qtransform.rl.mismatch import KEYS

LN = math.log


def test_a_padded_batch_equals_the_hand_computation():
    # sequence 0: two real tokens, one pad; sequence 1: one real token, two pads
    trainer = torch.tensor([[LN(0.5), LN(0.25), 9.0], [LN(0.8), -3.0, 7.0]], dtype=torch.float64)
    rollout = torch.tensor([[LN(0.25), LN(0.25), -5.0], [LN(0.4), 1.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    m = mismatch_metrics(trainer, rollout, mask)
    assert set(m) == set(KEYS)

    # token log-ratios r = trainer - rollout over the three real tokens: ln 2, 0, ln 2
    r = [LN(2), 0.0, LN(2)]
    assert m["kl"] == pytest.approx(-sum(r) / 3, abs=1e-12)
    assert m["k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 3, abs=1e-12)
    assert m["chi2_token"] == pytest.approx((4 + 1 + 4) / 3 - 1, abs=1e-12)
    # per sequence: mean log-probs trainer (ln .5 + ln .25)/2, ln .8; rollout ln .25, ln .4
    mt = [(LN(0.5) + LN(0.25)) / 2, LN(0.8)]
    mr = [LN(0.25), LN(0.4)]
    assert m["training_ppl"] == pytest.approx((math.exp(-mt[0]) + 1 / 0.8) / 2, abs=1e-12)
    assert m["rollout_ppl"] == pytest.approx((4 + 2.5) / 2, abs=1e-12)
    diff = [mr[0] - mt[0], mr[1] - mt[1]]  # -ln2/2, -ln2
    assert m["log_ppl_diff"] == pytest.approx(-0.75 * LN(2), abs=1e-12)
    assert m["log_ppl_abs_diff"] == pytest.approx(0.75 * LN(2), abs=1e-12)
    assert m["ppl_ratio"] == pytest.approx((math.exp(diff[0]) + 0.5) / 2, abs=1e-12)
    # sequence weights: exp(ln 2 + 0) = 2 and exp(ln 2) = 2: equal, so the ESS is the whole batch
    assert m["chi2_seq"] == pytest.approx((4 + 4) / 2 - 1, abs=1e-12)
    assert m["ess"] == pytest.approx(1.0, abs=1e-12)
    # token ratios 2, 1, 2: torch.quantile interpolates linearly between the sorted 1, 2, 2
    assert (m["ratio_p05"], m["ratio_p50"], m["ratio_p95"]) == pytest.approx((1.1, 2.0, 2.0))


def test_unequal_sequence_weights_give_the_hand_ess_and_rows_without_tokens_are_left_out():
    trainer = torch.tensor([[0.0, 0.0], [LN(3.0), 0.0], [5.0, 5.0]], dtype=torch.float64)
    rollout = torch.zeros(3, 2, dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])  # the last row is padding only
    m = mismatch_metrics(trainer, rollout, mask)
    w = [1.0, 3.0]
    assert m["ess"] == pytest.approx(sum(w) ** 2 / (2 * sum(x * x for x in w)), abs=1e-12)  # 0.8
    assert m["chi2_seq"] == pytest.approx((1 + 9) / 2 - 1, abs=1e-12)
    assert m["kl"] == pytest.approx(-LN(3) / 4, abs=1e-12)
    assert m["training_ppl"] == pytest.approx((1 + 3 ** -0.5) / 2, abs=1e-12)


def test_no_mask_means_every_token_counts_and_padding_values_do_not_matter():
    gen = torch.Generator().manual_seed(0)
    trainer = -torch.rand(4, 6, generator=gen) * 3
    rollout = -torch.rand(4, 6, generator=gen) * 3
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    assert mismatch_metrics(trainer, rollout) == mismatch_metrics(trainer, rollout, torch.ones(4, 6))
    other_t, other_r = trainer.clone(), rollout.clone()
    other_t[1, 4:], other_r[1, 4:] = 50.0, -50.0
    assert mismatch_metrics(other_t, other_r, mask) == mismatch_metrics(trainer, rollout, mask)


def test_extreme_ratios_are_clamped_like_verl_and_stay_finite():
    trainer = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[-30.0, -30.0]])  # r = 30 per token, 60 per sequence
    m = mismatch_metrics(trainer, rollout)
    assert m["chi2_token"] == pytest.approx(math.exp(40) - 1, rel=1e-12)
    assert m["chi2_seq"] == pytest.approx(math.exp(40) - 1, rel=1e-12)
    assert m["ess"] == 1.0 and all(math.isfinite(v) for v in m.values())


log_probs = st.lists(st.floats(-8.0, 0.0), min_size=6, max_size=6)


@settings(max_examples=60, deadline=None)
@given(st.lists(log_probs, min_size=1, max_size=4), st.data())
def test_identical_policies_have_no_mismatch(rows, data):
    lp = torch.tensor(rows, dtype=torch.float32)
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=6, max_size=6),
                                           min_size=len(rows), max_size=len(rows))))
    mask[0, 0] = True
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m["kl"] == m["k3_kl"] == m["chi2_token"] == m["chi2_seq"] == 0.0
    assert m["log_ppl_diff"] == m["log_ppl_abs_diff"] == 0.0
    assert m["ppl_ratio"] == m["ess"] == m["ratio_p05"] == m["ratio_p95"] == 1.0
    assert m["training_ppl"] == m["rollout_ppl"]


@settings(max_examples=60, deadline=None)
@given(st.lists(log_probs, min_size=1, max_size=4), st.lists(log_probs, min_size=4, max_size=4))
def test_divergences_are_nonnegative_and_ess_is_a_fraction(trainer, rollout):
    t = torch.tensor(trainer)
    r = torch.tensor(rollout[: len(trainer)])
    m = mismatch_metrics(t, r)
    assert m["k3_kl"] >= 0.0 and m["log_ppl_abs_diff"] >= abs(m["log_ppl_diff"]) - 1e-12
    assert m["chi2_token"] >= -1.0 and m["chi2_seq"] >= -1.0
    assert 0.0 < m["ess"] <= 1.0 + 1e-12
    assert m["ratio_p05"] <= m["ratio_p50"] <= m["ratio_p95"]


def test_bad_shapes_and_empty_masks_are_named():
    lp = torch.zeros(2, 3)
    with pytest.raises(UserError, match="one shape"):
        mismatch_metrics(lp, torch.zeros(2, 4))
    with pytest.raises(UserError, match="mask's shape"):
        mismatch_metrics(lp, lp, torch.ones(2, 4))
    with pytest.raises(UserError, match="no real token"):
        mismatch_metrics(lp, lp, torch.zeros(2, 3))
