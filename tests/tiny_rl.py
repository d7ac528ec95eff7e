"""Tiny real parts for the RL integration tests: a Qwen2 shaped for vLLM's CPU kernels
(head_dim 32), a word-level tokenizer built offline, and the folder an engine loads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 128


def tiny_qwen2(seed: int = 0, layers: int = 2) -> Qwen2ForCausalLM:
    """2 layers, hidden 64, 2 heads of 32 (vLLM's CPU attention needs head_dim >= 32)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Words "w2" ... "w127" split on spaces; id 0 pads, id 1 ends a sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>")


def prompts(n: int, length: int = 5, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, length), generator=g)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def save_folder(model: Qwen2ForCausalLM, path: Path) -> Path:
    """The model folder an engine loads (config, safetensors, tokenizer)."""
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
