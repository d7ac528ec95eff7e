"""GPU figures in one run: fake quantization, a W4A16 forward and training step, rollout weights.

Run on a machine with a CUDA device (docs/benchmarks.md, "GPU", records the card and figures):

    python benches/bench_gpu.py                       # everything, 8192x8192 bf16 formats
    python benches/bench_gpu.py --only formats --size 4096

1. Fake quantization of one `--size`² tensor (bf16 and fp32) with mxfp4, nvfp4 and mxfp8_e4m3,
   against the floor `x * 2.0` on the same tensor (goal: at most 1.5x), against the reference
   path (`QTRANSFORM_FASTPATH=0`, eager torch on the GPU), and against torchao's MX/NVFP4 fake
   quantization where torchao imports, with the share of bit-identical elements.
2. A Qwen2 model (Qwen2.5-1.5B's shape by default, bf16, random weights): forward and training
   step (forward, backward, AdamW) of the W4A16 model against the plain one.
3. `rollout_weights` of the W4A16 + AQN model against a `state_dict()` copy.

Every timing is CUDA events around one call after warm-up; the cases of a table run once per
round, rounds interleaved, and the table gives medians and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from collections.abc import Callable

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform
from qtransform.formats import fake_quantize

FORMATS = ("mxfp4", "nvfp4", "mxfp8_e4m3")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cuda_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def rounds(cases: dict[str, Callable[[], object]], n: int, warmup: int = 3) -> dict[str, list[float]]:
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(n):
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for key in order:
            times[key].append(cuda_ms(cases[key]))
    return times


def ratio(times: dict[str, list[float]], key: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(times[key], times[base], strict=True))


def identical_share(a: torch.Tensor, b: torch.Tensor) -> float:
    view = torch.int16 if b.element_size() == 2 else torch.int32
    return (a.to(b.dtype).contiguous().view(view) == b.contiguous().view(view)).double().mean().item()


def torchao_cases(x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    try:
        from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    except Exception as err:  # noqa: BLE001 - any import failure means: no peer in this run
        print(f"torchao: not importable ({type(err).__name__}: {err}); skipped")
        return {}

    def mx(elem: torch.dtype) -> Callable[[], torch.Tensor]:
        return lambda: MXTensor.to_mx(x, elem, 32).dequantize(x.dtype)

    def nvfp4() -> torch.Tensor:
        scale = x.abs().amax().float() / (F8E4M3_MAX * F4_E2M1_MAX)
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)

    cases = {"mxfp4": mx(torch.float4_e2m1fn_x2), "mxfp8_e4m3": mx(torch.float8_e4m3fn),
             "nvfp4": nvfp4}
    for fmt, fn in list(cases.items()):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a peer that fails here is reported, not timed
            print(f"torchao {fmt}: failed ({type(err).__name__}: {err}); skipped")
            del cases[fmt]
    return cases


def bench_formats(args: argparse.Namespace, out: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.dtypes.split(","):
        x = torch.randn(args.size, args.size, device="cuda", generator=g).to(DTYPES[name])
        cases: dict[str, Callable[[], object]] = {"floor": lambda x=x: x * 2.0}
        for fmt in FORMATS:
            cases[fmt] = lambda fmt=fmt, x=x: fake_quantize(x, fmt)
        peers = {f"torchao {f}": fn for f, fn in torchao_cases(x).items()}
        cases.update(peers)
        times = rounds(cases, args.runs)
        os.environ["QTRANSFORM_FASTPATH"] = "0"
        ref = rounds({f"reference {f}": (lambda f=f, x=x: fake_quantize(x, f)) for f in FORMATS} |
                     {"floor": cases["floor"]}, max(3, args.runs // 3), warmup=1)
        del os.environ["QTRANSFORM_FASTPATH"]
        med = {k: statistics.median(v) for k, v in (times | ref).items()}
        rows = []
        print(f"\n{name} {args.size}x{args.size}: floor x * 2.0 {med['floor']:.3f} ms "
              f"(median of {args.runs} interleaved rounds)")
        print("| format | qtransform ms | / floor | reference path ms | torchao ms | "
              "torchao / qtransform | bit-identical to torchao |\n|---|---:|---:|---:|---:|---:|---:|")
        for fmt in FORMATS:
            peer = f"torchao {fmt}"
            row = {"dtype": name, "format": fmt, "ms": med[fmt], "floor_ratio": ratio(times, fmt, "floor"),
                   "reference_ms": med[f"reference {fmt}"]}
            if peer in times:
                row |= {"torchao_ms": med[peer], "torchao_over_ours": ratio(times, peer, fmt),
                        "identical_to_torchao": identical_share(peers[peer](), fake_quantize(x, fmt))}
            rows.append(row)
            print(f"| {fmt} | {row['ms']:.3f} | {row['floor_ratio']:.2f}x | {row['reference_ms']:.3f} | "
                  f"{row.get('torchao_ms', float('nan')):.3f} | {row.get('torchao_over_ours', float('nan')):.2f}x | "
                  f"{row.get('identical_to_torchao', float('nan')) * 100:.2f} % |")
        out.setdefault("formats", []).extend(rows)
        out.setdefault("floor_ms", {})[name] = med["floor"]


def qwen2(args: argparse.Namespace) -> Qwen2ForCausalLM:
    """Qwen2.5-1.5B's shape (hidden 1536, intermediate 8960, 12 heads, 2 KV heads, vocab 151936)
    with `--layers` decoder layers, random weights, built on the GPU in bf16."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                      num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device("cuda"):
        return Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16)


def policy(fmt: str, noise: bool = False) -> dict:
    p: dict = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"],
                                           "format": fmt, "tensors": ["weight"]}]}
    if noise:
        p["noise"] = {"targets": ["RMSNorm"], "schedule": {
            "sigma_start": 1e-2, "sigma_end": 1e-4, "num_stages": 10, "total_steps": 100}}
    return p


def forward(m: torch.nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    def run() -> None:
        with torch.no_grad():
            m(input_ids=ids, use_cache=False)
    return run


def train_step(m: torch.nn.Module, ids: torch.Tensor) -> Callable[[], object]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, foreach=True)

    def run() -> None:
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def model_row(plain: torch.nn.Module, fmt: str, ids: torch.Tensor, runs: int) -> dict:
    """Forward (no_grad) and training step of the W4A16 model against the plain one."""
    fwd = rounds({"plain": forward(plain, ids),
                  fmt: forward(qtransform.transform(plain, policy(fmt)), ids)}, runs)
    base = copy.deepcopy(plain).train()  # trained copies: `plain` stays untouched
    train = rounds({"plain": train_step(base, ids),
                    fmt: train_step(qtransform.transform(base, policy(fmt)).train(), ids)},
                   runs, warmup=2)
    return {"format": fmt, "forward_ms": statistics.median(fwd[fmt]),
            "plain_forward_ms": statistics.median(fwd["plain"]), "forward_ratio": ratio(fwd, fmt, "plain"),
            "step_ms": statistics.median(train[fmt]), "plain_step_ms": statistics.median(train["plain"]),
            "step_ratio": ratio(train, fmt, "plain")}


def bench_model(args: argparse.Namespace, out: dict) -> None:
    plain = qwen2(args).eval()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    print(f"\nQwen2 shape: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"vocab {args.vocab}, {sum(p.numel() for p in plain.parameters()) / 1e9:.2f}B params, bf16, "
          f"batch {args.batch}x{args.seq}")
    for fmt in args.model_formats.split(","):
        row = model_row(plain, fmt, ids, args.runs)
        torch.cuda.empty_cache()
        out.setdefault("model", []).append(row)
        print(f"| W4A16 {fmt} | forward {row['forward_ms']:.2f} ms vs {row['plain_forward_ms']:.2f} "
              f"({row['forward_ratio']:.3f}x) | training step {row['step_ms']:.2f} ms vs "
              f"{row['plain_step_ms']:.2f} ({row['step_ratio']:.3f}x) |")


def rollout_row(model: torch.nn.Module, fmt: str, runs: int) -> dict:
    """`rollout_weights` of the transformed model against a `state_dict()` copy."""
    def copy_all() -> None:
        for _, v in model.state_dict().items():
            v.clone()

    def stream() -> None:
        for _, v in qtransform.rollout_weights(model):
            del v

    times = rounds({"copy": copy_all, "rollout": stream}, runs, warmup=2)
    return {"format": fmt, "copy_ms": statistics.median(times["copy"]),
            "rollout_ms": statistics.median(times["rollout"]), "ratio": ratio(times, "rollout", "copy")}


def bench_rollout(args: argparse.Namespace, out: dict) -> None:
    for fmt in args.model_formats.split(","):
        model = qtransform.transform(qwen2(args).eval(), policy(fmt, noise=True), inplace=True)
        qtransform.noise_controller(model).set_step(50)
        row = rollout_row(model, fmt, args.runs)
        del model
        torch.cuda.empty_cache()
        out.setdefault("rollout", []).append(row)
        print(f"| rollout_weights {fmt} + AQN | {row['rollout_ms']:.2f} ms | state_dict copy "
              f"{row['copy_ms']:.2f} ms | {row['ratio']:.2f}x |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["formats", "model", "rollout"], default=None)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--model-formats", default="mxfp4,nvfp4")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this bench measures the GPU path")
        return 1
    import triton

    props = torch.cuda.get_device_properties(0)
    out: dict = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                 "cuda": torch.version.cuda}
    print(f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
    for part, fn in (("formats", bench_formats), ("model", bench_model), ("rollout", bench_rollout)):
        if args.only in (None, part):
            fn(args, out)
    out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(f"\npeak GPU memory allocated: {out['peak_memory_gib']:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
