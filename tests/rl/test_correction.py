"""Corrections: importance weights (token, sequence, geometric; truncated, masked), IcePop and verl's
rejection options, each against values computed by hand from known ratios."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.errors import UserError
from qtransform.rl import Correction, icepop_mask, importance_weights, rejection_mask

LN = math.log
F64 = torch.float64


def batch(ratios: list[list[float]], mask: list[list[int]] | None = None):
    """Log-probs whose token ratios π_trainer / π_rollout are `ratios` (rollout at log 0.5)."""
    rollout = torch.full((len(ratios), len(ratios[0])), LN(0.5), dtype=F64)
    trainer = rollout + torch.tensor([[LN(x) for x in row] for row in ratios], dtype=F64)
    return trainer, rollout, None if mask is None else torch.tensor(mask, dtype=F64)


RATIOS = [[4.0, 0.5, 1.0], [1.5, 3.0, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]  # the 9 is padding


def test_token_weights_truncated_and_masked():
    t, r, m = batch(RATIOS, MASK)
    w = importance_weights(t, r, m, level="token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 2.0, 0.0]], dtype=F64))
    w = importance_weights(t, r, m, level="token", threshold=2.0, lower=0.8)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.8, 1.0], [1.5, 2.0, 0.0]], dtype=F64))
    w = importance_weights(t, r, m, level="token", mode="mask", threshold=2.0, lower=0.8)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0], [1.5, 0.0, 0.0]], dtype=F64))


def test_sequence_and_geometric_weights():
    t, r, m = batch(RATIOS, MASK)
    # sequence products: 4 * 0.5 * 1 = 2 and 1.5 * 3 = 4.5 (the padded 9 is not a factor)
    w = importance_weights(t, r, m, level="sequence", threshold=10.0)
    torch.testing.assert_close(w, torch.tensor([[2.0] * 3, [4.5, 4.5, 0.0]], dtype=F64))
    w = importance_weights(t, r, m, level="sequence", mode="mask", threshold=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0] * 3, [0.0] * 3], dtype=F64))
    # geometric: 2 ** (1/3) and 4.5 ** (1/2)
    w = importance_weights(t, r, m, level="geometric", threshold=10.0)
    g0, g1 = 2 ** (1 / 3), 4.5 ** 0.5
    torch.testing.assert_close(w, torch.tensor([[g0] * 3, [g1, g1, 0.0]], dtype=F64))


def test_icepop_masks_tokens_outside_the_bounds():
    t, r, m = batch(RATIOS, MASK)
    keep = icepop_mask(t, r, m, low=0.5, high=2.0)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64))


def test_rejection_options_follow_verl():
    t, r, m = batch(RATIOS, MASK)
    # seq_sum_k1 bounds Π π_rollout / π_trainer: 1/2 and 1/4.5; "0.3_3" keeps only the first
    keep = rejection_mask(t, r, m, rollout_rs="seq_sum_k1", threshold="0.3_3")
    torch.testing.assert_close(keep, torch.tensor([[1.0] * 3, [0.0] * 3], dtype=F64))
    # one number u means [1/u, u]: token_k1 with 2 keeps inverse ratios 1/4, 2, 1 -> no, yes, yes
    keep = rejection_mask(t, r, m, rollout_rs="token_k1", threshold=2.0)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64))
    # token_k2 = (ln ratio)^2 / 2 <= 0.5 keeps |ln ratio| <= 1: 4 out, 0.5 in, 1 in; 1.5 in, 3 out
    keep = rejection_mask(t, r, m, rollout_rs="token_k2", threshold=0.5)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64))
    # seq_max_k3: max of x - 1 - ln x per sequence: 4 - 1 - ln 4 = 1.614; 3 - 1 - ln 3 = 0.901
    keep = rejection_mask(t, r, m, rollout_rs="seq_max_k3", threshold=1.0)
    torch.testing.assert_close(keep, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]], dtype=F64))
    # seq_mean_k3: (1.614 + (0.5 - 1 - ln .5) + 0) / 3 = 0.602 and (0.0945 + 0.901) / 2 = 0.498
    keep = rejection_mask(t, r, m, rollout_rs="seq_mean_k3", threshold=0.55)
    torch.testing.assert_close(keep, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]], dtype=F64))
    # options chain: every one must pass
    keep = rejection_mask(t, r, m, rollout_rs="seq_mean_k3,token_k1", threshold="0.55,2")
    torch.testing.assert_close(keep, torch.tensor([[0.0] * 3, [1.0, 0.0, 0.0]], dtype=F64))


def test_a_correction_multiplies_weights_icepop_and_rejection():
    t, r, m = batch(RATIOS, MASK)
    c = Correction(rollout_is="token", rollout_is_threshold=2.0, icepop=(0.4, 3.5),
                   rollout_rs="seq_sum_k1", rollout_rs_threshold="0.3_3")
    torch.testing.assert_close(c.weights(t, r, m),
                               torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.0, 0.0]], dtype=F64))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.floats(-6.0, 0.0), min_size=5, max_size=5), min_size=1, max_size=4),
       st.sampled_from(["token", "sequence", "geometric"]), st.sampled_from(["truncate", "mask"]))
def test_identical_policies_get_weight_one_on_every_real_token(rows, level, mode):
    lp = torch.tensor(rows, dtype=F64)
    mask = torch.ones_like(lp)
    mask[:, -1] = 0
    w = importance_weights(lp, lp.clone(), mask, level=level, mode=mode, threshold=1.0)
    assert torch.equal(w, mask)
    assert torch.equal(icepop_mask(lp, lp.clone(), mask), mask)
    assert torch.equal(rejection_mask(lp, lp.clone(), mask, rollout_rs="seq_mean_k2", threshold=1e-9), mask)


def test_bad_configurations_name_the_fix():
    with pytest.raises(UserError, match="level"):
        Correction(rollout_is="tokens")
    with pytest.raises(UserError, match="rollout_rs_threshold"):
        Correction(rollout_rs="seq_sum_k1")
    with pytest.raises(UserError, match="unknown rollout_rs"):
        Correction(rollout_rs="seq_k1", rollout_rs_threshold=2.0)
    with pytest.raises(UserError, match="lower_upper"):
        Correction(rollout_rs="token_k1", rollout_rs_threshold="3_0.5")
    with pytest.raises(UserError, match="corrects nothing"):
        Correction(rollout_is=None)
    with pytest.raises(UserError, match="IcePop"):
        Correction(icepop=(2.0, 3.0))


def test_the_verl_config_carries_verls_names_and_icepop_as_token_k1():
    c = Correction(rollout_is="sequence", rollout_is_threshold=5.0, icepop=(0.5, 4.0),
                   rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.01,2")
    section = c.to_verl()["algorithm"]["rollout_correction"]
    assert section == {"rollout_is": "sequence", "rollout_is_threshold": 5.0,
                       "rollout_is_batch_normalize": False, "bypass_mode": False,
                       "rollout_rs": "seq_mean_k3,token_k1,token_k1",
                       "rollout_rs_threshold": "0.01,0.5_2,0.25_2"}
    assert c.to_verl()["actor_rollout_ref"]["rollout"]["calculate_log_probs"] is True
    # verl's token_k1 keeps 0.25 <= π_rollout/π_trainer <= 2: IcePop's [0.5, 4] on the inverse
    t, r, m = batch(RATIOS, MASK)
    assert torch.equal(rejection_mask(t, r, m, rollout_rs="token_k1", threshold="0.25_2"),
                       icepop_mask(t, r, m, low=0.5, high=4.0))
    for unsupported in (Correction(rollout_is="geometric"), Correction(rollout_is_mode="mask"),
                        Correction(rollout_is_lower=0.5)):
        with pytest.raises(UserError, match="verl"):
            unsupported.to_verl()


def test_the_verl_keys_exist_in_verls_config_schema():
    algorithm = pytest.importorskip("verl.trainer.config.algorithm")  # verl is not installed here
    rollout = pytest.importorskip("verl.workers.config.rollout")
    import dataclasses

    config = Correction(icepop=(0.5, 2.0)).to_verl()
    fields = {f.name for f in dataclasses.fields(algorithm.RolloutCorrectionConfig)}
    assert set(config["algorithm"]["rollout_correction"]) <= fields
    assert "calculate_log_probs" in {f.name for f in dataclasses.fields(rollout.RolloutConfig)}


def test_the_documented_verl_snippet_is_what_to_verl_returns():
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "rl.md").read_text()
    block = text.split("# Correction(rollout_is=\"token\", rollout_is_threshold=2.0, icepop=(0.5, 2.0)).to_verl()\n")[1]
    documented = yaml.safe_load(block.split("```")[0])
    assert documented == Correction(rollout_is="token", rollout_is_threshold=2.0, icepop=(0.5, 2.0)).to_verl()
