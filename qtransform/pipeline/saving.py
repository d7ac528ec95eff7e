"""Saving a transformed model so that it reloads.

A transformed model is the original weights plus a policy: fake-quant, taps and noise are nodes,
never written into the weights. So a saved transformed model is a normal `save_pretrained`
folder (the original, full-precision weights, loadable by any transformers code) with the policy
beside it; `load_transformed` rebuilds the transformed model from the two. Calibrated static
scales are state the policy cannot rebuild: they go to their own file (`SCALES_FILE`, one fp32
amax per static scale, by module path; a quantized checkpoint's stored scale under its path plus
`STORED_SUFFIX`), never into the weights' state dict. The tokenizer of the
folder the model came from goes with it, so the saved folder is a model folder the scans (text
calibration) and inference engines can use as they used the original.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qtransform.core import io as qio
from qtransform.core.observers import StoredScale, static_scales
from qtransform.core.sites import ADAPTER_KEYS, hf_name
from qtransform.errors import UserError
from qtransform.models import load_model, source_tokenizer
from qtransform.pipeline.transform import transform, transform_program
from qtransform.schemas import PolicyLike, dump_policy, load_policy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

POLICY_FILE = "qtransform_policy.json"
SCALES_FILE = "qtransform_scales.safetensors"  # calibrated static scales (module path -> amax)
STORED_SUFFIX = ":stored"  # a key of SCALES_FILE holding a checkpoint's stored scale, not an amax
ADAPTER_DIR = "adapter"  # a PEFT model's adapter, beside the base weights


def save_transformed(model: nn.Module, policy: PolicyLike, out_dir: str | os.PathLike, *,
                     force: bool = False, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """Write `save_pretrained` output, the policy and the tokenizer to `out_dir`, atomically as a
    folder. `tokenizer` defaults to the one saved beside the folder the model was loaded from.

    `out_dir` may be absent, empty or a previous `save_transformed` output; any other folder is
    refused unless `force` (see `qtransform.core.io.output_folder`).
    """
    with qio.output_folder(out_dir, "transform", force=force) as staging:
        write_transformed(model, policy, staging, tokenizer=tokenizer)
    return Path(out_dir)


def is_peft(model: nn.Module) -> bool:
    """A PEFT model (LoRA and friends): its own `save_pretrained` writes the adapter only."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own weights under its own names: adapters left out, PEFT's prefix and
    `base_layer` removed (what the base checkpoint held before `get_peft_model`)."""
    return {hf_name(name): tensor for name, tensor in model.state_dict().items()
            if not any(f".{key}." in name for key in ADAPTER_KEYS)}


def write_transformed(model: nn.Module, policy: PolicyLike, folder: Path, *,
                      tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """The files of a saved transformed model, into an existing (staging) folder.

    A PEFT model is saved as its base model (clean weights, loadable by any transformers code)
    with the adapter in `adapter/`, so `load_transformed` rebuilds base, adapter and policy.
    `tokenizer` (default: the one beside the folder the model was loaded from, if any) is saved
    beside the weights."""
    if not hasattr(model, "save_pretrained"):
        raise UserError(f"{type(model).__name__} has no save_pretrained; save its state_dict and policy")
    if is_peft(model):
        model.get_base_model().save_pretrained(folder, state_dict=base_state_dict(model))
        model.save_pretrained(folder / ADAPTER_DIR)
    else:
        model.save_pretrained(folder)
    tokenizer = tokenizer if tokenizer is not None else source_tokenizer(model)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    qio.write_json(folder / POLICY_FILE, dump_policy(load_policy(policy)))
    scales = base_names(static_scales(model), model)
    if scales:
        uncalibrated = [name for name, scale in scales.items() if not scale.frozen]
        if uncalibrated:
            raise UserError(f"{uncalibrated[0]}: a static scale is not calibrated; transform with "
                            "calibration= before saving")
        save_file({name + STORED_SUFFIX if scale.stored else name:
                   (scale.scale if scale.stored else scale.amax).detach().cpu().clone()
                   for name, scale in scales.items()}, str(folder / SCALES_FILE))


def base_names(scales: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Static scales under the names they have in the base model (a PEFT model saves its base
    model, which `load_transformed` wraps again)."""
    if not is_peft(model):
        return scales
    prefix = "base_model.model."
    return {name.removeprefix(prefix): scale for name, scale in scales.items()}


def load_transformed(folder: str | os.PathLike) -> nn.Module:
    """Reload a folder written by `save_transformed`: the weights (and adapter), transformed by
    its policy."""
    path = Path(folder)
    if not (path / POLICY_FILE).exists():
        raise UserError(f"{path}: no {POLICY_FILE}; was it written by `qtransform transform`?")
    model = load_model(path)
    if (path / ADAPTER_DIR).is_dir():
        try:  # peft is optional (qtransform[peft]): imported only for a folder with an adapter
            from peft import PeftModel
        except ImportError:
            raise UserError(f"{path} holds a PEFT adapter: install peft (pip install "
                            "'qtransform[peft]')") from None
        model = PeftModel.from_pretrained(model, path / ADAPTER_DIR, is_trainable=True)
    if not (path / SCALES_FILE).exists():
        return transform(model, path / POLICY_FILE, inplace=True)
    saved: dict[str, Any] = {
        name.removesuffix(STORED_SUFFIX): StoredScale(value) if name.endswith(STORED_SUFFIX) else value
        for name, value in load_file(str(path / SCALES_FILE)).items()}
    if is_peft(model):
        saved = {f"base_model.model.{name}": value for name, value in saved.items()}
    return transform_program(model, path / POLICY_FILE, inplace=True, scales=saved).module()
