"""The llm-compressor suite: runs in its own environment (constraints-llmc.txt, llmcompressor
0.14.0.1), never in the main one; `.ci/run` creates it. llm-compressor is the oracle: its
`oneshot` quantizes a tiny model in memory and the presets must give the same logits."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tests import machine  # noqa: E402

torch.set_num_threads(1)


def pytest_report_header(config) -> list[str]:
    return [*machine.header(), f"llmcompressor {machine.version('llmcompressor')}, "
                               f"compressed-tensors {machine.version('compressed-tensors')}"]
