"""examples/verl_rollout_sync.py with vLLM as the rollout: verl's per-tensor stream, filtered by
qtransform and pushed into vllm.LLM, serves what the base model loaded with rollout_weights runs."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def test_verl_shaped_sync_into_vllm():
    spec = importlib.util.spec_from_file_location("verl_example", REPO / "examples" / "verl_rollout_sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--tiny", "--target", "vllm"])
    assert result["engine_tokens"] == result["model_tokens"] and len(result["engine_tokens"]) == 8
