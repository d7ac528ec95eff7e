"""`export_checkpoint`: a transformed model as a Hugging Face folder an inference engine loads.

The flow: check the target folder, transform (when given a plain model and a policy), collect
what the model asks the checkpoint to hold (`collect.py`), map it to the format's schemes and
refuse what the format cannot express (every reason at once, before a file exists), then write
config.json (with `quantization_config`), generation_config.json, the tokenizer and the weights
one tensor at a time into a staging folder that is swapped in whole (`core.io.output_folder`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qtransform.calibration import CalibrationBatches
from qtransform.core import io as qio
from qtransform.core.program import insertion_log
from qtransform.core.sites import ADAPTER_KEYS, hf_name
from qtransform.errors import UserError
from qtransform.export.checkpoint.collect import Collected, collect, raise_refusals
from qtransform.export.checkpoint.formats import WRITERS, FormatWriter
from qtransform.export.checkpoint.kv import kv_cache
from qtransform.export.checkpoint.rotations import rotation_config, transform_tensors
from qtransform.export.checkpoint.source import source_weight
from qtransform.export.checkpoint.writer import DEFAULT_SHARD, Entry, Spec, shard_size, write_shards
from qtransform.models import source_tokenizer
from qtransform.pipeline import transform_program
from qtransform.schemas import PolicyLike

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMATS = tuple(WRITERS)
COMMAND = "export"  # the manifest's command: `qtransform export` writes these folders


def export_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    format: str = FORMATS[0],  # noqa: A002  (the word users know)
    policy: PolicyLike | None = None,
    calibration: CalibrationBatches | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_shard_size: int | str = DEFAULT_SHARD,
    requantize_lora: bool = False,
    force: bool = False,
) -> Path:
    """Write `model` as a quantized Hugging Face checkpoint folder (docs/export.md).

    Args:
        model: a transformed model (`qtransform.transform`'s result, PEFT-wrapped or not), or a
            plain model with `policy`.
        folder: the output folder: absent, empty, or an earlier export (else `force`); written
            into a staging folder and swapped in whole.
        format: "compressed-tensors" (llm-compressor's layout: vLLM, transformers) or
            "modelopt" (ModelOpt's `hf_quant_config.json` layout, NVFP4 and FP8).
        policy: a policy (dict, path or `Policy`) to transform a plain `model` with (a copy).
        calibration: batches for the policy's static scales (as `transform`'s).
        tokenizer: written beside the weights (`save_pretrained`); default the one beside the
            folder the model was loaded from, if any.
        max_shard_size: bytes (int) or a size such as "5GB"; past it the weights are sharded
            with a `model.safetensors.index.json`.
        requantize_lora: a LoRA adapter trained beside the quantized weight (lora "beside") is
            refused, since no quantized checkpoint computes quant(W) + s B A; True stores
            quant(W + s B A) instead (lora "merged" stores that anyway).

    What the format cannot express is refused before any file is written (`UserError`, one
    line): see docs/export.md. Noise passes are left out (the deployed model is clean).

    Example:
        >>> model = qtransform.transform(model, {"preset": "llm-compressor/NVFP4A16"})
        >>> qtransform.export_checkpoint(model, "qwen-nvfp4")
    """
    if format not in FORMATS:
        raise UserError(f"format {format!r}: choose one of {', '.join(FORMATS)}")
    shard_size(max_shard_size)
    qio.check_folder_target(folder, COMMAND, force=force)
    program = None
    if policy is not None:
        if insertion_log(model):
            raise UserError("the model is already transformed; pass it without policy=, or pass "
                            "the plain model with the policy")
        program = transform_program(model, policy, calibration=calibration)
        model = program.module()
    elif not insertion_log(model):
        raise UserError("the model has no quantization: pass a transformed model "
                        "(qtransform.transform) or policy=")
    with torch.no_grad():
        collected = collect(model, requantize_lora=requantize_lora)
        writer = WRITERS[format]
        found, refusals = writer.schemes(collected)
        kv, kv_refusals = kv_cache(collected)
        kv_scheme, scheme_refusals = writer.kv_cache(kv) if kv is not None else (None, [])
        raise_refusals(collected.refusals + refusals + kv_refusals + scheme_refusals, format)
        if not found and (kv is None or not writer.KV_ONLY):
            raise UserError("no Linear of the model is quantized: nothing to export in a "
                            f"{format} checkpoint" + (" (a KV cache alone has no form in it)" if kv else ""))
        transform_config = rotation_config(collected, policy, program) if writer.ROTATIONS else None
        entries = tensor_entries(model, collected, found, writer)
        entries += writer.kv_entries(kv, kv_scheme) if kv is not None else []
        entries += [_dense(name, t, lambda t=t: t) for name, t in transform_tensors(transform_config).items()]
        tokenizer = source_tokenizer(model) if tokenizer is None else tokenizer
        with qio.output_folder(folder, COMMAND, force=force) as staging:
            _write_config(model, staging, writer.quantization_config(collected, found, kv_scheme,
                                                                     transform_config))
            writer.write_extra(staging, collected, found, kv_scheme)
            _write_generation_config(model, staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            write_shards(staging, entries, max_shard_size)
    return Path(folder)


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_adapter(name: str) -> bool:
    return any(part in ADAPTER_KEYS for part in name.split("."))


def tensor_entries(model: nn.Module, collected: Collected, found: dict[str, Any],
                   writer: FormatWriter) -> list[Entry]:
    """The model's tensors in state-dict order under their HF names: each quantized Linear's
    weight replaced by its format's tensors, LoRA merged where a layer has an adapter, adapter
    tensors and tied duplicates dropped."""
    entries: list[Entry] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for raw, tensor in model.state_dict(keep_vars=True).items():
        if _is_adapter(raw):
            continue
        name = hf_name(raw)
        module, _, leaf = name.rpartition(".")
        linear = collected.linears.get(module)
        if linear is not None and leaf == "weight" and module in found:
            entries.append(writer.linear_entry(linear, found[module]))
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if linear is not None and leaf == "weight" and linear.rotation is not None and key in seen:
            raise UserError(f"{module} is rotated but shares its weight with another tensor (tied "
                            "embeddings), which a checkpoint stores once unrotated: leave it out "
                            "of the rotate rules")
        if tensor.numel() and key in seen:
            continue  # a tied weight is stored once (transformers re-ties it on load)
        seen.add(key)
        if linear is not None and leaf == "weight" and (linear.lora is not None or linear.rotation is not None):
            entries.append(_dense(name, tensor, lambda lin=linear: source_weight(lin)))
        else:
            entries.append(_dense(name, tensor, lambda t=tensor: t.detach()))
    return entries


def _dense(name: str, tensor: Tensor, make) -> Entry:
    return Entry((Spec(name, tensor.dtype, tuple(tensor.shape)),), lambda: {name: make()})


def _dtype_name(model: nn.Module) -> str | None:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _write_config(model: nn.Module, folder: Path, quantization_config: dict[str, Any]) -> None:
    base = _base(model)
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        raise UserError(f"{type(base).__name__} has no transformers config: a checkpoint "
                        "needs config.json (export a transformers model)")
    data = json.loads(config.to_json_string(use_diff=True))
    data["architectures"] = [type(base).__name__]
    dtype = _dtype_name(base)
    if dtype is not None:
        data["dtype"] = dtype
    data["quantization_config"] = quantization_config
    qio.write_text(folder / "config.json", json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_generation_config(model: nn.Module, folder: Path) -> None:
    base = _base(model)
    generation = getattr(base, "generation_config", None)
    can = getattr(base, "can_generate", None)
    if generation is not None and callable(can) and can():
        generation.save_pretrained(folder)
