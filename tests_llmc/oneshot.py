"""llm-compressor's own quantized model of a tiny transformers model: the oracle of tests_llmc/."""

from __future__ import annotations

import copy

import pytest
import torch


def run_oneshot(model: torch.nn.Module, recipe: list, batches: list[torch.Tensor], tmp_path) -> torch.nn.Module:
    """A copy of `model` after llm-compressor's `oneshot` with `recipe`, calibrated on `batches`
    (input_ids of shape [1, n]): the model it leaves in memory."""
    llmcompressor = pytest.importorskip("llmcompressor")
    from loguru import logger
    from tokenizers import Tokenizer, models
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerFast

    logger.remove()  # oneshot logs every stage through loguru
    model = copy.deepcopy(model)
    # oneshot reads the config back from name_or_path, and wants a processor with a dataset
    model.config.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    vocab = {"<unk>": 0}
    processor = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
    loader = DataLoader([{"input_ids": b[0]} for b in batches], batch_size=1)
    llmcompressor.oneshot(model=model, dataset=loader, processor=processor, recipe=recipe)
    return model


def llm_compressor_model(model: torch.nn.Module, scheme: str, batches: list[torch.Tensor],
                         tmp_path, kv_cache_scheme: dict | None = None) -> torch.nn.Module:
    """A copy of `model` quantized by llm-compressor's `oneshot` with its preset `scheme` and the
    examples' ignore list (and `kv_cache_scheme`, when given), calibrated on `batches` (input_ids
    of shape [1, n]): the fake-quantized model it leaves in memory."""
    pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                  kv_cache_scheme=kv_cache_scheme)
    return run_oneshot(model, recipe, batches, tmp_path)
