"""Calibration data: files, the built-in sentences, the sources `--calib` names, and the
padding-free batches that scans and the CLI's calibration run on (`CalibrationSpec`).

Scans compare activations token by token, so these batches never contain padding: sequences are
truncated to `max_length` and only sequences of equal length share a batch. Every measured
activation then belongs to a real token, and no attention mask has to reach the metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qtransform.core import io as qio
from qtransform.errors import UserError

Calibration = Tensor | Sequence[str] | Sequence[Sequence[int]]
MAX_CALIBRATION_BYTES = 64 * 2**20  # scans use a few hundred samples; more is a wrong file
BUILTIN = "builtin"  # the calibration source that names the demo's sentences

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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


def calibration_batches(calib: Calibration, *, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8,
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


def _batches(calib: Calibration, tokenizer: PreTrainedTokenizerBase | None, batch_size: int, max_length: int) -> list[Tensor]:
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


def read_source(source: str) -> Calibration:
    """The samples a calibration source names: "builtin", the demo's sentences (unless a file of
    that name exists), else a calibration file (`read_calibration`)."""
    if source == BUILTIN and not Path(source).exists():
        return builtin_calibration()
    return read_calibration(source)


@dataclass(frozen=True)
class CalibrationSpec:
    """Calibration data and how it becomes batches: token ids (a [N, T] tensor or lists), text
    (with `tokenizer`) or a float tensor of inputs for plain torch models; `batch_size` samples
    per batch, each truncated to `max_length` tokens. `source`: where the samples came from (a
    file, "builtin"), recorded in reports as `calibration.file`."""

    data: Calibration
    tokenizer: PreTrainedTokenizerBase | None = None
    batch_size: int = 8
    max_length: int = 128
    source: str | None = None

    @classmethod
    def read(cls, source: str, **kw: Any) -> CalibrationSpec:
        """The spec of the samples `source` names (`read_source`), as `--calib` reads it."""
        return cls(read_source(source), source=source, **kw)

    @classmethod
    def of(cls, calib: CalibrationSpec | Calibration, tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8,
           max_length: int = 128) -> CalibrationSpec:
        """`calib` when it is a spec already (its own settings hold), else the spec of these
        samples: how every scan function takes its calibration arguments."""
        if isinstance(calib, CalibrationSpec):
            return calib
        return cls(calib, tokenizer, batch_size, max_length)

    def batches(self, model: nn.Module, device: torch.device | None = None,
                dtype: torch.dtype | None = None) -> list[Tensor]:
        """Padding-free batches checked against `model`, on `device` (float inputs in `dtype`)."""
        batches = calibration_batches(self.data, tokenizer=self.tokenizer, batch_size=self.batch_size,
                                      max_length=self.max_length, model=model)
        return [b.to(device, dtype if b.is_floating_point() else None) for b in batches]

    def meta(self, batches: list[Tensor], **extra: Any) -> dict[str, Any]:
        """What a report records about the calibration it ran."""
        return {"batches": len(batches), "samples": sum(len(b) for b in batches),
                "batch_size": self.batch_size, "max_length": self.max_length, **extra,
                **({"file": self.source} if self.source is not None else {})}
