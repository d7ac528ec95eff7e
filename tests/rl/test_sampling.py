"""The sampler replay: temperature, top-k, top-p and min-p as the engines process them. In
transformers' order the processed logits equal transformers' own logits processors bit for bit;
each step and vLLM's order are checked on hand-worked distributions."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from qtransform.errors import UserError
from qtransform.rl import Sampling


def transformers_processed(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """What generate's sampling processors make of `logits` (its own order and classes)."""
    steps = []
    if s.temperature != 1.0:
        steps.append(tf.TemperatureLogitsWarper(s.temperature))
    if s.top_k > 0:
        steps.append(tf.TopKLogitsWarper(top_k=s.top_k))
    if s.top_p < 1.0:
        steps.append(tf.TopPLogitsWarper(top_p=s.top_p))
    if s.min_p > 0:
        steps.append(tf.MinPLogitsWarper(min_p=s.min_p))
    return tf.LogitsProcessorList(steps)(torch.zeros((logits.shape[0], 1), dtype=torch.long), logits)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.3, 0.7, 1.0, 1.3]),
       top_k=st.sampled_from([0, 1, 5, 40]), top_p=st.sampled_from([1.0, 0.95, 0.8, 0.3]),
       min_p=st.sampled_from([0.0, 0.05, 0.2]), scale=st.sampled_from([0.5, 3.0, 10.0]))
def test_the_hf_order_equals_transformers_processors_bit_for_bit(seed, temperature, top_k, top_p,
                                                                 min_p, scale):
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(seed)) * scale
    s = Sampling(temperature, top_k, top_p, min_p, order="hf")
    assert torch.equal(s.process(logits), transformers_processed(logits.clone(), s))


P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)


def kept(s: Sampling) -> list[int]:
    return torch.isfinite(s.process(P.log().float())).nonzero().squeeze(-1).tolist()


def test_each_step_by_hand():
    logits = P.log().float()
    assert kept(Sampling()) == [0, 1, 2, 3, 4] and Sampling().is_identity
    assert kept(Sampling(top_k=2)) == [0, 1]
    assert kept(Sampling(top_p=0.8)) == [0, 1, 2]  # 0.05 + 0.1 <= 0.2 removed, 0.3 > 0.2 kept
    assert kept(Sampling(min_p=0.35)) == [0, 1]  # below 0.35 * 0.5
    lp = Sampling(top_p=0.8).logprobs(logits)
    torch.testing.assert_close(lp[:3].exp(), P[:3] / 0.85, rtol=1e-6, atol=0)
    assert lp[3] == -math.inf and lp[4] == -math.inf
    hot = Sampling(temperature=0.5).logprobs(logits).exp()  # p^2, renormalized
    torch.testing.assert_close(hot, P**2 / (P**2).sum(), rtol=1e-6, atol=0)


def test_vllm_applies_min_p_first_and_transformers_last():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64).log().float()
    vllm = Sampling(top_p=0.75, min_p=0.3, order="vllm")
    hf = Sampling(top_p=0.75, min_p=0.3, order="hf")
    # vllm: min-p removes p < 0.12 (0.1), leaving (0.444, 0.333, 0.222); top-p 0.75 then removes
    # the tail whose cumulative probability is <= 0.25: 0.222.
    assert torch.isfinite(vllm.process(p)).tolist() == [True, True, False, False]
    # transformers: top-p 0.75 on the full distribution removes 0.1 (cumulative 0.1 <= 0.25, then
    # 0.3); min-p keeps p >= 0.3 * max, which 0.2 / 0.4 is.
    assert torch.isfinite(hf.process(p)).tolist() == [True, True, True, False]
    # top-k and min-p commute (min-p compares with the largest probability, which top-k keeps)
    for k in (1, 2, 3):
        a, b = Sampling(top_k=k, min_p=0.6, order="vllm"), Sampling(top_k=k, min_p=0.6, order="hf")
        assert torch.equal(a.process(p), b.process(p))


def test_bad_parameters_are_user_errors():
    for kwargs, word in (({"temperature": 0.0}, "temperature"), ({"top_k": -2}, "top_k"),
                         ({"top_p": 0.0}, "top_p"), ({"min_p": 1.0}, "min_p"),
                         ({"order": "sglang"}, "order")):
        with pytest.raises(UserError, match=word):
            Sampling(**kwargs)
