"""Log-probs of a vLLM run (JSON rows: prompt, tokens, prompt_logprobs, logprobs, as
`tests_vllm/kv_engine.py` writes them) against transformers on the same sequences, teacher-forced:
mean and max |Δ log-prob| over every prompt position and generated token, for the unquantized
model (PLAIN_DIR, optional), qtransform's producer simulation of the quantized folder
(`checkpoint_policy(model)`) and its vLLM CPU engine simulation (`checkpoint_policy(model,
engine="vllm", backend="cpu")`: the quantized-linear and attention kernels).

usage: python benches/engine_linears.py VLLM_OUT.json QUANT_DIR [PLAIN_DIR] [--attn eager|sdpa]
       [--dtype bfloat16]   (an unquantized QUANT_DIR: the engine section alone)
"""

from __future__ import annotations

import argparse
import json

import torch

import qtransform
from qtransform.models import load_model


def figures(model: torch.nn.Module, rows: list[dict]) -> tuple[float, float]:
    diffs = []
    for row in rows:
        seq = torch.tensor([row["prompt"] + row["tokens"]])
        with torch.no_grad():
            logp = model(seq).logits[0].float().log_softmax(-1)
        ours = logp[:-1].gather(1, seq[0, 1:, None])[:, 0]
        diffs.append((ours - torch.tensor(row["prompt_logprobs"][1:] + row["logprobs"])).abs())
    d = torch.cat(diffs).double()
    return float(d.mean()), float(d.max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("quant")
    parser.add_argument("plain", nargs="?")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the dtype vLLM ran in (its `dtype=`)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    rows = json.loads(open(args.out).read())
    opened = load_model(args.quant, dtype=dtype)
    opened.set_attn_implementation(args.attn)
    if qtransform.checkpoint_policy(opened) is None:  # an unquantized run: the engine section alone
        models = {"unquantized model": opened, "engine simulation": qtransform.transform(
            opened, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})}
    else:
        models = {"qtransform without the engine": qtransform.transform(opened, qtransform.checkpoint_policy(opened)),
                  "engine simulation": qtransform.transform(
                      opened, qtransform.checkpoint_policy(opened, engine="vllm", backend="cpu"))}
    if args.plain and args.plain != args.quant:
        plain = load_model(args.plain, dtype=dtype)
        plain.set_attn_implementation(args.attn)
        models = {"unquantized model": plain, **models}
    for name, model in models.items():
        mean, worst = figures(model, rows)
        print(f"{name}: mean {mean:.3e} max {worst:.3e}", flush=True)


if __name__ == "__main__":
    main()
