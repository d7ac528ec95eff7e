"""ModelOpt's Hugging Face layout (placeholder until written)."""

from __future__ import annotations

NAME = "modelopt"


def schemes(collected):
    return {}, ["the modelopt writer is not there yet"]
