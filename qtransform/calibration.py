"""Calibration data and runs: files, the built-in sentences, padding-free batches for activation
scans, and the calibration of static scales (`calibrate`).

Scans compare activations token by token, so batches never contain padding: sequences are
truncated to `max_length` and only sequences of equal length share a batch. Every measured
activation then belongs to a real token, and no attention mask has to reach the metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core import io as qio
from qtransform.core.capture import normalize_inputs
from qtransform.core.noise import noise_modules
from qtransform.core.observers import collect, static_scales
from qtransform.errors import UserError

Calibration = Tensor | Sequence[str] | Sequence[Sequence[int]]
MAX_CALIBRATION_BYTES = 64 * 2**20  # scans use a few hundred samples; more is a wrong file


def builtin_calibration() -> list[str]:
    """The demo's 16 calibration sentences (qtransform/data/calibration.txt)."""
    text = resources.files("qtransform").joinpath("data/calibration.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_calibration(path: str | os.PathLike) -> list[str] | list[list[int]]:
    """Samples from a file: `.json` holds a list of strings or of token-id lists; any other file
    is text with one sample per line (blank lines skipped)."""
    path = Path(path)
    text = qio.read_input_text(path, "calibration file", limit=MAX_CALIBRATION_BYTES)
    if path.suffix.lower() != ".json":
        samples: list = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        try:
            samples = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
        texts = isinstance(samples, list) and all(isinstance(s, str) for s in samples)
        ids = isinstance(samples, list) and all(
            isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in s)
            for s in samples)
        if not (texts or ids):
            raise UserError(f"{path}: expected a JSON list of strings or of token-id lists")
    if not samples:
        raise UserError(f"{path}: no calibration samples")
    return samples


def calibration_batches(calib: Calibration, *, tokenizer: Any = None, batch_size: int = 8,
                        max_length: int = 128, model: nn.Module | None = None) -> list[Tensor]:
    """Padding-free batches of token ids (text goes through `tokenizer`), or batches of rows of a
    float tensor (inputs of plain torch models). With `model`, the batches are checked against it
    before any forward: token ids inside its vocabulary, and a model a scan can run."""
    if batch_size < 1 or max_length < 1:
        raise UserError("batch_size and max_length must be positive")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):  # before tokenizing: the model decides
        raise UserError(f"{type(model).__name__} is an encoder-decoder model: activation scans run "
                        "decoder-only or encoder-only models; scan its weights instead (no --calib)")
    batches = _batches(calib, tokenizer, batch_size, max_length)
    check_token_ids(getattr(config, "vocab_size", None), batches)
    return batches


def check_token_ids(vocab: int | None, batches: list[Tensor]) -> None:
    """Token ids must index the model's embedding: an out-of-range id is a user error worth one
    line, not an index error deep inside an embedding."""
    for batch in batches:
        if vocab and not batch.is_floating_point() and batch.numel():
            lo, hi = int(batch.min()), int(batch.max())
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise UserError(f"calibration token id {bad} is outside the model's vocabulary "
                                f"(0 to {vocab - 1}); use ids of this model's tokenizer")


def _batches(calib: Calibration, tokenizer: Any, batch_size: int, max_length: int) -> list[Tensor]:
    if isinstance(calib, Tensor):
        if calib.is_floating_point():
            return list(calib.split(batch_size))
        if calib.dim() != 2:
            raise UserError(f"token ids must be a [samples, tokens] tensor, got shape {tuple(calib.shape)}")
        return list(calib[:, :max_length].long().split(batch_size))
    samples = list(calib)
    if not samples:
        raise UserError("no calibration samples")
    if all(isinstance(s, str) for s in samples):
        if tokenizer is None:
            raise UserError("text calibration needs the model's tokenizer (the CLI loads the one "
                            "saved beside the model; builtin models have none): give token ids")
        samples = tokenizer(samples, truncation=True, max_length=max_length)["input_ids"]
    by_length: dict[int, list[list[int]]] = {}
    for i, sample in enumerate(samples):
        ids = [int(t) for t in list(sample)[:max_length]]
        if not ids:
            raise UserError(f"calibration sample {i} is empty")
        by_length.setdefault(len(ids), []).append(ids)
    try:
        return [torch.tensor(group[k:k + batch_size]) for group in by_length.values()
                for k in range(0, len(group), batch_size)]
    except (OverflowError, RuntimeError, ValueError):
        raise UserError("a calibration token id does not fit in 64 bits; use ids of this model's "
                        "tokenizer") from None


def run_model(model: nn.Module, batch: Tensor) -> Any:
    """One forward on a calibration batch (causal LMs without a KV cache)."""
    if batch.is_floating_point():
        return model(batch)
    args, kwargs = normalize_inputs(model, {"input_ids": batch})
    return model(*args, **kwargs)


CalibrationBatches = Iterable[Mapping[str, Any] | Tensor]


def calibrate(model: nn.Module, batches: CalibrationBatches, *, attention: str = "model") -> int:
    """Calibrate every static scale of a transformed model on `batches` (model-input dicts, or
    input_ids / input tensors), then freeze them; returns the number of batches.

    The model runs as it would deployed before quantization, as llm-compressor's and ModelOpt's
    calibration do: eval mode, no gradient, every fake-quant and noise module passing its tensor
    through (`core.observers.collecting`), no KV cache; `attention` "eager" runs transformers'
    eager attention meanwhile (llm-compressor's calibration does). Training mode, noise switches
    and the attention are put back afterwards. A static scale that no batch reached is an error
    naming it."""
    scales = static_scales(model)
    if not scales:
        return 0
    for scale in scales.values():
        scale.start()
    noise = [(m, m.enabled) for m in noise_modules(model)]
    training = [(m, m.training) for m in model.modules()]
    count = 0
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    try:
        if attention == "eager" and config is not None:
            config._attn_implementation = "eager"
        model.eval()
        for m, _ in noise:
            m.enabled = False
        with torch.no_grad(), collect():
            for batch in batches:
                run_batch(model, batch)
                count += 1
    finally:
        if attention == "eager" and config is not None:
            config._attn_implementation = attn
        for m, enabled in noise:
            m.enabled = enabled
        for m, mode in training:
            m.training = mode
    if count == 0:
        raise UserError("calibration: no batches; give at least one batch of model inputs")
    missed = [name for name, scale in scales.items() if scale.calls == 0]
    if missed:
        raise UserError(f"calibration: no batch reached {len(missed)} static scale(s), e.g. "
                        f"{missed[0]}; calibrate on inputs that run those modules")
    for scale in scales.values():
        scale.freeze()
    return count


def run_batch(model: nn.Module, batch: Mapping[str, Any] | Tensor) -> Any:
    """One forward on a batch of model inputs (a dict of keyword inputs, token ids or a float
    input tensor), moved to the model's device, without a KV cache."""
    device = next((p.device for p in model.parameters()), None)
    if isinstance(batch, Tensor):
        return run_model(model, batch if device is None else batch.to(device))
    if not isinstance(batch, Mapping):
        raise UserError(f"a calibration batch must be a dict of model inputs or a tensor of "
                        f"token ids, got {type(batch).__name__}")
    inputs = {k: v.to(device) if isinstance(v, Tensor) and device is not None else v
              for k, v in batch.items()}
    args, kwargs = normalize_inputs(model, inputs)
    return model(*args, **kwargs)
