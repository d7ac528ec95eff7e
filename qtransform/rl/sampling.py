"""The rollout sampler's processed distribution: what an engine's processed log-probs are.

Engines sample from logits processed by temperature, top-k, top-p and min-p, and report the
sampled token's log-prob under that processed, renormalized distribution (vLLM with
`logprobs_mode="processed_logprobs"`, as TRL starts it; transformers' `generate` scores). A
trainer that scores the full vocabulary at temperature 1 sees a gap that is the sampler, not the
numerics (huggingface/trl#6789: a model against itself at top-p 0.8 shows a spurious KL). `Sampling`
replays the sampler on any logits, so both sides are compared on the same distribution.

The steps, each on the distribution the previous one left (renormalized), in fp32 as both
engines compute them; a removed token gets log-prob -inf:

- temperature: logits / T;
- top-k: remove tokens whose logit is below the k-th largest (ties at the k-th kept);
- top-p: sort ascending, remove the tokens whose cumulative probability is <= 1 - p, the most
  likely token always kept;
- min-p: remove tokens whose probability is below min_p times the largest.

Order, which matters only when min-p is combined with top-k or top-p: "vllm" (vLLM V1's
`Sampler.sample`: temperature, min-p, then top-k and top-p) or "hf" (transformers' `generate`:
temperature, top-k, top-p, min-p).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from qtransform.errors import UserError

ORDERS = ("vllm", "hf")


@dataclass(frozen=True)
class Sampling:
    """Sampler parameters as vLLM and transformers name them (0 / 1.0 switch a filter off)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    order: str = "vllm"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(f"temperature must be > 0 for sampling, got {self.temperature} "
                            "(greedy decoding has no distribution to compare)")
        if self.top_k < 0 and self.top_k != -1:
            raise UserError(f"top_k must be >= 0 (0 or -1: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"min_p must be in [0, 1) (0: off), got {self.min_p}")
        if self.order not in ORDERS:
            raise UserError(f"order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    @property
    def is_identity(self) -> bool:
        """True when the processed distribution is the model's own (temperature 1, no filter)."""
        return self.temperature == 1.0 and self.top_k <= 0 and self.top_p == 1.0 and self.min_p == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def generate_kwargs(self) -> dict[str, Any]:
        """The same sampler for transformers' `generate` (its own default top_k of 50 switched off)."""
        return {"do_sample": True, "temperature": self.temperature, "top_k": max(self.top_k, 0),
                "top_p": self.top_p, "min_p": self.min_p or None}

    def process(self, logits: Tensor) -> Tensor:
        """Processed logits (fp32, -inf where a filter removed the token), [..., vocab]."""
        x = logits.float() / self.temperature if self.temperature != 1.0 else logits.float()
        steps = ((self._min_p, self._top_k, self._top_p) if self.order == "vllm"
                 else (self._top_k, self._top_p, self._min_p))
        for step in steps:
            x = step(x)
        return x

    def logprobs(self, logits: Tensor) -> Tensor:
        """Log-probs of the processed, renormalized distribution (float64), [..., vocab]."""
        return self.process(logits).double().log_softmax(-1)

    def _top_k(self, x: Tensor) -> Tensor:
        if self.top_k <= 0 or self.top_k >= x.shape[-1]:
            return x
        kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
        return x.masked_fill(x < kth, -math.inf)

    def _top_p(self, x: Tensor) -> Tensor:
        if self.top_p >= 1.0:
            return x
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cumulative = sorted_x.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - self.top_p
        remove[..., -1] = False  # the most likely token stays
        return x.masked_fill(remove.scatter(-1, order, remove), -math.inf)

    def _min_p(self, x: Tensor) -> Tensor:
        if self.min_p <= 0.0:
            return x
        probs = x.softmax(-1)
        return x.masked_fill(probs < self.min_p * probs.amax(-1, keepdim=True), -math.inf)
