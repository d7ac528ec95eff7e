"""Exported checkpoints in vllm-cpu: each llm-compressor scheme exported by
`export_checkpoint` either loads and gives the logprobs of the model qtransform opens from the
same folder, or is refused by vLLM's CPU build for the reason docs/export.md records
("Opening checkpoints and what engines accept"). One engine per scheme, started here."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform
from qtransform.models import checkpoint_policy, load_model

# vllm-cpu 0.x (constraints-vllm.txt): what it does with each scheme's checkpoint
LOADS = ["W4A16", "W8A8", "FP8_DYNAMIC"]
REFUSED = {  # scheme -> the words of vLLM's refusal, at start-up or at the first forward
    "NVFP4A16": "Marlin FP4 not available",
    "NVFP4": "Failed to find a kernel that can implement the NVFP4 linear layer",
    "MXFP4A16": "Failed to find a kernel that can implement the MXFP4 linear layer",
    "MXFP4": "Failed to find a kernel that can implement the MXFP4 linear layer",
    "FP8": "static_scaled_fp8_quant",
    # which refusal depends on the CPU: with AMX tiles vLLM picks fp8_scaled_mm_cpu, which fails
    # on the bf16 scales; without them (an EPYC, say) it finds no block-scaled FP8 kernel at all
    "FP8_BLOCK": "expected scalar type Float but found BFloat16|requires AMX tile support",
}
TOLERANCE = 0.05  # logprob: vLLM's CPU kernels (oneDNN int8/fp8 GEMMs) round differently


def model() -> Qwen2ForCausalLM:
    """head_dim 64 (vLLM's CPU attention refuses 16), kv projections 128 wide (FP8_BLOCK's tile)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def export(scheme: str, folder) -> tuple[torch.Tensor, list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (1, 16), generator=g) for _ in range(4)]
    prompts = torch.randint(0, 256, (3, 12), generator=g)
    transformed = qtransform.transform(model(), {"preset": f"llm-compressor/{scheme}"},
                                       calibration=batches)
    qtransform.export_checkpoint(transformed, folder)
    return prompts, [row.tolist() for row in prompts]


def engine(folder):
    vllm = pytest.importorskip("vllm")
    return vllm.LLM(str(folder), dtype="bfloat16", enforce_eager=True, max_model_len=64,
                    skip_tokenizer_init=True, seed=0, max_num_seqs=4)


@pytest.mark.parametrize("scheme", LOADS)
def test_vllm_cpu_gives_the_opened_checkpoints_logprobs(scheme, tmp_path):
    vllm = pytest.importorskip("vllm")
    prompts, rows = export(scheme, tmp_path / "ckpt")
    llm = engine(tmp_path / "ckpt")
    outs = llm.generate([{"prompt_token_ids": r} for r in rows],
                        vllm.SamplingParams(max_tokens=1, logprobs=5, temperature=0.0))
    del llm
    gc.collect()
    opened = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        ours = qtransform.transform(opened, checkpoint_policy(opened))(prompts).logits[:, -1]
    ours = torch.log_softmax(ours.float(), dim=-1)
    for row, out in zip(ours, outs, strict=True):
        top = out.outputs[0].logprobs[0]
        assert int(row.argmax()) in top
        gaps = [abs(lp.logprob - row[token].item()) for token, lp in top.items()]
        print(f"{scheme}: max |logprob difference| {max(gaps):.4f}")
        assert max(gaps) < TOLERANCE, scheme


@pytest.mark.parametrize("scheme", sorted(REFUSED))
def test_vllm_cpu_refuses_these_schemes_for_the_recorded_reason(scheme, tmp_path):
    vllm = pytest.importorskip("vllm")
    _, rows = export(scheme, tmp_path / "ckpt")
    with pytest.raises(Exception, match=REFUSED[scheme]):
        engine(tmp_path / "ckpt").generate([{"prompt_token_ids": rows[0]}],
                                           vllm.SamplingParams(max_tokens=1))
    gc.collect()
