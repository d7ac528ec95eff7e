"""Shared test setup: few threads (CI has 2 cores), tiny real transformers models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


def pytest_report_header(config) -> list[str]:
    return machine.header()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny():
    """Factory for tiny config-built transformers models with seeded weights."""
    from qtransform.models import build_tiny

    return build_tiny


def ids(batch: int = 2, seq: int = 8, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
