"""`qtransform parity`: how far a rollout engine's per-token log-probs drift from the trainer's
(the transformed HF model), on given or random prompts; JSON, Markdown and a histogram PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from qtransform.core.io import check_folder_target, output_folder, read_input_text
from qtransform.errors import UserError
from qtransform.models import input_paths, load_model
from qtransform.pipeline import transform
from qtransform.rl import HFEngine, noise_controller, parity, rollout_weights
from qtransform.schemas import load_policy

EPILOG = """examples:
  qtransform parity ./Qwen2.5-0.5B --policy w4a16_aqn.json --engine vllm --step 120 --out parity/
  qtransform parity builtin:qwen2 --policy w4a16_aqn.json --engine clean --out parity/clean
  qtransform parity builtin:qwen2 --policy w4a16.json --engine rollout-weights --phase rollout --out p/

engines:
  rollout-weights  the original architecture loaded with qtransform.rollout_weights (what a
                   correct sync serves; with --phase rollout the gap must be ~0)
  clean            the original architecture with the clean weights (a sync that forgot the
                   transform: shows the gap)
  vllm             vllm.LLM on the model folder, rollout weights pushed (needs vllm installed)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="rollout/trainer log-prob parity report (mean/max |Δ|, KL "
                                      "k1/k3, greedy agreement)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF/safetensors folder or builtin:<arch>")
    p.add_argument("--policy", required=True, help="policy JSON the trainer's model is transformed with")
    p.add_argument("--engine", choices=("rollout-weights", "clean", "vllm"), default="rollout-weights")
    p.add_argument("--out", required=True, help="folder for parity.json/.md/.png")
    p.add_argument("--force", action="store_true", help="replace --out even when qtransform did not write it")
    p.add_argument("--step", type=int, default=0, help="noise controller step (default 0)")
    p.add_argument("--phase", choices=("train", "rollout"), default="train",
                   help="trainer log-probs from the policy update's forward (train) or the "
                        "rollout's (rollout: noise included)")
    p.add_argument("--prompts", metavar="FILE",
                   help="JSON list of token-id lists (default: random prompts, --num-prompts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report JSON on stdout")
    p.set_defaults(func=run_parity)


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    if args.prompts:
        data = json.loads(read_input_text(args.prompts, "prompts file"))
        if not (isinstance(data, list) and all(isinstance(p, list) and p for p in data)):
            raise UserError(f"{args.prompts}: give a JSON list of non-empty token-id lists")
        return [[int(t) for t in p] for p in data]
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(2, vocab, (args.num_prompts, args.prompt_length), generator=g).tolist()


def _engine(args: argparse.Namespace, model: torch.nn.Module):
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
                       seed=args.seed)
        push_weights(llm, rollout_weights(model))
        return VLLMEngine(llm, seed=args.seed)
    plain = load_model(args.model)
    if args.engine == "rollout-weights":
        plain.load_state_dict(dict(rollout_weights(model)))
    return HFEngine(plain.eval())


def run_parity(args: argparse.Namespace) -> int:
    protect = input_paths(args.model, args.policy, args.prompts)
    check_folder_target(args.out, "parity", force=args.force, protect=protect)  # before any work
    model = transform(load_model(args.model), load_policy(args.policy)).eval()
    if args.step:
        noise_controller(model).set_step(args.step)
    engine = _engine(args, model)
    report = parity(model, engine, _prompts(args, model.config.vocab_size),
                                  max_new_tokens=args.max_new_tokens, phase=args.phase,
                                  seed=args.seed)
    with output_folder(args.out, "parity", force=args.force, protect=protect) as staging:
        names = [path.name for path in report.write(staging).values()]
    if args.json:
        print((Path(args.out) / "parity.json").read_text(), end="")
    else:
        print(f"mean |Δ log-prob| {report.mean_abs_delta:.3e}  max {report.max_abs_delta:.3e}  "
              f"k1 {report.mean_k1:.3e}  k3 {report.mean_k3:.3e}  greedy agreement "
              f"{report.greedy_agreement}")
        print(f"wrote {', '.join(str(Path(args.out) / n) for n in names)}")
    return 0
