"""Observers against hand computations: llm-compressor 0.14's statistics (per group of the
format's block, min and max over the tokens; static = running min/max, minmax = moving average
per group, memoryless = the last call), with values chosen so every fp32 operation is exact."""

from __future__ import annotations

import pytest
import torch

from qtransform.core.observers import StaticScale, group_min_max, make_observer


def batch(*groups: tuple[float, float]) -> torch.Tensor:
    """One token row whose groups of 4 hold (lo, hi) and zeros between: [lo, hi, 0, 0] each."""
    row = []
    for lo, hi in groups:
        row += [lo, hi, 0.0, 0.0]
    return torch.tensor([row], dtype=torch.float32)


def test_group_min_max_reduces_tokens_and_each_group():
    x = torch.tensor([[[1.0, -2.0, 3.0, 0.5], [-4.0, 0.0, 0.0, 9.0]]])  # 2 tokens, 2 groups of 2
    lo, hi = group_min_max(x, 2)
    assert lo.tolist() == [-4.0, 0.0] and hi.tolist() == [1.0, 9.0]
    lo, hi = group_min_max(x, 0)  # one group: the whole row
    assert lo.tolist() == [-4.0] and hi.tolist() == [9.0]


def test_group_min_max_zero_pads_the_last_group():
    lo, hi = group_min_max(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]), 4)
    assert lo.tolist() == [1.0, 0.0] and hi.tolist() == [4.0, 5.0]


def test_static_minmax_is_the_extreme_of_every_call():
    obs = make_observer("static_minmax", 4)
    obs.observe(batch((-1.0, 4.0), (0.0, 1.0)))
    obs.observe(batch((0.0, 2.0), (-7.0, 8.0)))
    obs.observe(batch((0.0, 0.5), (0.0, 0.5)))
    assert obs.amax().item() == 8.0
    obs.observe(batch((-9.0, 0.0), (0.0, 0.0)))
    assert obs.amax().item() == 9.0  # a negative extreme counts by its magnitude


def test_minmax_averages_each_group_not_the_tensor_amax():
    obs = make_observer("minmax", 4, averaging_constant=0.25)
    obs.observe(batch((0.0, 4.0), (0.0, 1.0)))
    assert obs.amax().item() == 4.0  # the first call as it is
    obs.observe(batch((0.0, 0.0), (0.0, 8.0)))
    # per group: 4 * 0.75 + 0 * 0.25 = 3 and 1 * 0.75 + 8 * 0.25 = 2.75; the amax is 3
    # (an average of the tensor amaxes would give 4 * 0.75 + 8 * 0.25 = 5)
    assert obs.amax().item() == 3.0
    obs.observe(batch((-16.0, 0.0), (0.0, 0.0)))
    # mins: 0 * 0.75 + (-16) * 0.25 = -4 in group 0
    assert obs.amax().item() == 4.0


def test_minmax_default_constant_is_llm_compressors():
    obs = make_observer("minmax", 4)
    obs.observe(batch((0.0, 1.0)))
    obs.observe(batch((0.0, 101.0)))
    expected = torch.tensor(1.0) * (1.0 - 0.01) + torch.tensor(101.0) * 0.01
    assert obs.amax().item() == expected.item()


def test_memoryless_minmax_keeps_the_last_call():
    obs = make_observer("memoryless_minmax", 4)
    obs.observe(batch((0.0, 9.0)))
    obs.observe(batch((-2.0, 1.0)))
    assert obs.amax().item() == 2.0


def test_all_zero_and_positive_only_statistics():
    obs = make_observer("static_minmax", 0)
    obs.observe(torch.zeros(3, 8))
    assert obs.amax().item() == 0.0
    obs = make_observer("static_minmax", 0)
    obs.observe(torch.full((2, 8), 3.0))  # min 3 > 0: the amax is the max, never -min
    assert obs.amax().item() == 3.0


def test_statistics_keep_the_activation_dtype():
    obs = make_observer("minmax", 0, averaging_constant=0.5)
    obs.observe(torch.tensor([[1.0]], dtype=torch.bfloat16))
    obs.observe(torch.tensor([[2.0]], dtype=torch.bfloat16))
    assert obs.max_vals.dtype == torch.bfloat16 and obs.amax().dtype == torch.float32


def test_static_scale_freezes_and_reports_missing_data():
    scale = StaticScale("static_minmax", 4)
    assert not scale.frozen and torch.isnan(scale.amax)
    scale.start()
    with pytest.raises(ValueError, match="no calibration data"):
        scale.freeze()
    scale.start()
    scale.observe(batch((-3.0, 2.0)))
    scale.freeze()
    assert scale.frozen and scale.amax.item() == 3.0 and scale.amax.dtype == torch.float32
    assert "amax" not in scale.state_dict() and not list(scale.parameters())


def test_one_input_shared_by_sites_is_reduced_once_and_rewrites_are_seen():
    from qtransform.core.observers import collect

    q, k, v = (StaticScale("static_minmax", 4) for _ in range(3))
    x = batch((-3.0, 2.0))
    with collect():
        q.observe(x)
        k.observe(x)  # the same tensor: the statistics of q's call
        x.mul_(2.0)  # written in place: read again
        v.observe(x)
    for s in (q, k, v):
        s.freeze()
    assert (q.amax.item(), k.amax.item(), v.amax.item()) == (3.0, 3.0, 6.0)


def test_real_rows_follow_the_attention_mask():
    from qtransform.core.observers import collect, real_rows, real_tokens, route
    from qtransform.errors import UserError

    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    x = torch.arange(6.0).reshape(2, 3, 1)  # [batch, tokens, features]: token t of row b is 3b + t
    with collect(), real_tokens(mask):
        assert real_rows(x).flatten().tolist() == [0.0, 1.0, 4.0, 5.0]
        assert real_rows(x.reshape(6, 1)).flatten().tolist() == [0.0, 1.0, 4.0, 5.0]
        route(torch.tensor([5, 2, 0, 2]), 6)  # an experts module's rows: tokens 5, 2, 0, 2
        assert real_rows(torch.tensor([[50.0], [20.0], [0.0], [21.0]]), routed=True).flatten().tolist() == [50.0, 0.0]
        with pytest.raises(UserError, match=r"shape \(2, 1\) has no token positions of the attention_mask \[2, 3\]"):
            real_rows(torch.zeros(2, 1))
        scale = StaticScale("static_minmax", 0)
        scale.observe(x * torch.tensor([1.0, 1.0, -100.0, -100.0, 1.0, 1.0]).reshape(2, 3, 1))
        assert scale.calls == 1
    scale.freeze()
    assert scale.amax.item() == 5.0  # the padded -200 and -300 are not seen
    with real_tokens(torch.ones(2, 3)):
        assert real_rows(x) is x  # no padding: the tensor as it is
