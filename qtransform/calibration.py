"""Calibration data for activation scans: files, the built-in sentences, padding-free batches.

Scans compare activations token by token, so batches never contain padding: sequences are
truncated to `max_length` and only sequences of equal length share a batch. Every measured
activation then belongs to a real token, and no attention mask has to reach the metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core.capture import normalize_inputs
from qtransform.errors import UserError

Calibration = Tensor | Sequence[str] | Sequence[Sequence[int]]


def builtin_calibration() -> list[str]:
    """The demo's 16 calibration sentences (qtransform/data/calibration.txt)."""
    text = resources.files("qtransform").joinpath("data/calibration.txt").read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_calibration(path: str | os.PathLike) -> list[str] | list[list[int]]:
    """Samples from a file: `.json` holds a list of strings or of token-id lists; any other file
    is text with one sample per line (blank lines skipped)."""
    path = Path(path)
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot read calibration file: {exc}") from None
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
                        max_length: int = 128) -> list[Tensor]:
    """Padding-free batches of token ids (text goes through `tokenizer`), or batches of rows of a
    float tensor (inputs of plain torch models)."""
    if batch_size < 1 or max_length < 1:
        raise UserError("batch_size and max_length must be positive")
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
    return [torch.tensor(group[k:k + batch_size]) for group in by_length.values()
            for k in range(0, len(group), batch_size)]


def run_model(model: nn.Module, batch: Tensor) -> Any:
    """One forward on a calibration batch (causal LMs without a KV cache)."""
    if batch.is_floating_point():
        return model(batch)
    args, kwargs = normalize_inputs(model, {"input_ids": batch})
    return model(*args, **kwargs)
