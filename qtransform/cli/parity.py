"""`qtransform parity`: how far a rollout engine's per-token log-probs drift from the trainer's
(the transformed HF model), on given or random prompts, under the rollout's sampler; verl's
mismatch metrics with the original model's floor, optionally per site; JSON, Markdown and a
histogram PNG."""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from qtransform.core.engines import BACKENDS
from qtransform.core.io import check_folder_target, output_folder, read_input_text
from qtransform.core.noise import noise_modules
from qtransform.errors import UserError
from qtransform.export.checkpoint import export_checkpoint
from qtransform.models import input_paths, is_quantized_folder, load_model, load_tokenizer
from qtransform.pipeline import transform
from qtransform.report.run_pages import parity_page
from qtransform.report.scan_pages import command_line
from qtransform.rl import HFEngine, noise_controller, parity, rollout_weights, simulated_engine
from qtransform.schemas import load_policy

EPILOG = """examples:
  qtransform parity ./Qwen2.5-0.5B --policy w4a16_aqn.json --engine vllm --step 120 --out parity/
  qtransform parity ./SmolLM2-135M --policy w4a16.json --engine clean --prompts prompts.txt \
      --temperature 0.7 --top-p 0.8 --attribute --out parity/clean
  qtransform parity builtin:qwen2 --policy w4a16.json --engine rollout-weights --phase rollout --out p/
  qtransform parity ./SmolLM2-W8A8 --policy w8a8.json --engine vllm --simulate --backend cpu \
      --attribute --out parity/engine   # what vLLM's kernels add, without vLLM

engines:
  rollout-weights  the original architecture loaded with qtransform.rollout_weights (what a
                   correct sync serves; with --phase rollout the gap must be ~0)
  clean            the original architecture with the clean weights (a sync that forgot the
                   transform: shows the gap)
  vllm             vllm.LLM on the model folder, rollout weights pushed, processed log-probs
                   (needs vllm installed); with --simulate no vLLM runs: the policy's checkpoint
                   (exported to a temporary folder; a quantized MODEL folder as it is) opened as
                   vLLM runs it on --backend (checkpoint_policy(engine="vllm"), docs/engines.md)

prompts: a text file, one prompt per line (encoded with the model folder's tokenizer), or a JSON
list of token-id lists.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="rollout/trainer log-prob parity report (mean/max |Δ|, KL "
                                      "k1/k3, greedy agreement)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF/safetensors folder or builtin:<arch>")
    p.add_argument("--policy", required=True, help="policy JSON the trainer's model is transformed with")
    p.add_argument("--engine", choices=("rollout-weights", "clean", "vllm"), default="rollout-weights")
    p.add_argument("--simulate", action="store_true",
                   help="--engine vllm without vLLM: qtransform's simulation of vLLM serving the "
                        "policy's checkpoint (or the quantized MODEL folder itself)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="with --simulate: vLLM's backend (auto: the model's device)")
    p.add_argument("--out", required=True, help="folder for parity.json/.md/.png")
    p.add_argument("--force", action="store_true", help="replace --out even when qtransform did not write it")
    p.add_argument("--step", type=int, default=0, help="noise controller step (default 0)")
    p.add_argument("--phase", choices=("train", "rollout"), default="train",
                   help="trainer log-probs from the policy update's forward (train) or the "
                        "rollout's (rollout: noise included)")
    p.add_argument("--prompts", metavar="FILE",
                   help="text file, one prompt per line, or a JSON list of token-id lists "
                        "(default: random token prompts, --num-prompts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampler temperature")
    p.add_argument("--top-k", type=int, default=0, help="rollout sampler top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="rollout sampler top-p (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="rollout sampler min-p (0: off)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the original model's floor (one forward per prompt less)")
    p.add_argument("--attribute", action="store_true",
                   help="rank sites by the mismatch each adds alone (one forward per site and prompt)")
    p.add_argument("--json", action="store_true", help="print the report JSON on stdout")
    p.set_defaults(func=run_parity)


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]] | list[str]:
    if args.prompts:
        text = read_input_text(args.prompts, "prompts file")
        try:
            data = json.loads(text)
        except ValueError:
            lines = [line for line in text.splitlines() if line.strip()]
            if not lines:
                raise UserError(f"{args.prompts}: no prompt in it (one prompt per line)") from None
            return lines
        if not (isinstance(data, list) and data and all(isinstance(p, list) and p for p in data)):
            raise UserError(f"{args.prompts}: give one text prompt per line, or a JSON list of "
                            "non-empty token-id lists")
        return [[int(t) for t in p] for p in data]
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(2, vocab, (args.num_prompts, args.prompt_length), generator=g).tolist()


def _policy_meta(path: str) -> dict[str, Any]:
    text = read_input_text(path, "policy file")
    return {"policy_path": path, "policy_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "policy": json.loads(text)}


def _engine(args: argparse.Namespace, model: torch.nn.Module):
    if args.simulate:
        if is_quantized_folder(args.model):
            return simulated_engine(args.model, backend=args.backend)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        with tempfile.TemporaryDirectory(prefix="qtransform-parity-") as tmp:
            export_checkpoint(model, Path(tmp) / "checkpoint")  # the folder vLLM would serve
            return simulated_engine(Path(tmp) / "checkpoint", backend=args.backend, dtype=dtype)
    if args.engine == "vllm":
        if args.model.startswith("builtin:"):
            raise UserError("--engine vllm needs a model folder (vLLM loads it from disk)")
        try:
            import vllm
        except ImportError as exc:
            raise UserError("--engine vllm needs vllm (the second environment: "
                            "constraints-vllm.txt)") from exc
        from qtransform.integrations.vllm import VLLMEngine, push_weights

        llm = vllm.LLM(args.model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                       seed=args.seed, logprobs_mode="processed_logprobs")
        push_weights(llm, rollout_weights(model))
        return VLLMEngine(llm, seed=args.seed)
    plain = load_model(args.model)
    if args.engine == "rollout-weights":
        plain.load_state_dict(dict(rollout_weights(model)))
    return HFEngine(plain.eval(), name=f"{args.engine} (transformers)")


def run_parity(args: argparse.Namespace) -> int:
    if args.simulate and args.engine != "vllm":
        raise UserError(f"--simulate simulates vLLM; drop it with --engine {args.engine}, or use --engine vllm")
    if args.backend != "auto" and not args.simulate:
        raise UserError(f"--backend {args.backend} picks the simulated engine's backend; add --simulate")
    protect = input_paths(args.model, args.policy, args.prompts)
    check_folder_target(args.out, "parity", force=args.force, protect=protect)  # before any work
    policy = load_policy(args.policy)
    model = transform(load_model(args.model), policy).eval()
    if noise_modules(model):
        noise_controller(model).hold(args.step)  # one step, evaluated once: no loop steps it
    elif args.step:
        raise UserError(f"--step {args.step}: the policy has no noise section, so there is no step")
    prompts = _prompts(args, model.config.vocab_size)
    tokenizer = load_tokenizer(args.model)
    if prompts and isinstance(prompts[0], str) and tokenizer is None:
        raise UserError(f"{args.prompts}: text prompts need a tokenizer, and {args.model} has none "
                        "(give a JSON list of token-id lists)")
    engine = _engine(args, model)
    report = parity(model, engine, prompts, max_new_tokens=args.max_new_tokens, phase=args.phase,
                    seed=args.seed, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, min_p=args.min_p, floor=not args.no_floor,
                    attribute=args.attribute, tokenizer=tokenizer,
                    metadata={"model_path": args.model, "engine_kind": args.engine + (f" simulated ({args.backend})" if args.simulate else ""),
                              **_policy_meta(args.policy)})
    with output_folder(args.out, "parity", force=args.force, protect=protect) as staging:
        names = [path.name for path in report.save(staging).values()]
        names.append(parity_page(report, command=command_line()).write(staging / "parity.html").name)
    if args.json:
        print((Path(args.out) / "parity.json").read_text(), end="")
    else:
        agree = "n/a" if report.greedy_agreement is None else f"{report.greedy_agreement:.4f}"
        print(f"mean |Δ log-prob| {report.mean_abs_delta:.3e}  max {report.max_abs_delta:.3e}  "
              f"greedy agreement {agree}")
        print("\n".join(report.summary()))
        print(f"wrote {', '.join(str(Path(args.out) / n) for n in names)}")
    return 0
