"""Per-rank memory held by a transformed model under FSDP2 and DDP: 1 process vs 2 gloo ranks.

    .venv/bin/python benches/bench_fsdp.py [--hidden 512] [--layers 8] [--format nvfp4]

"Held by the model" is what a rank keeps in tensors: the local part of every parameter (its
shard under FSDP2) and every tensor the inserted modules keep (the fake-quant weight cache, AQN's
z). It is counted before the first step, right after a training forward (before backward), and
after the step (optimizer step, `zero_grad`, noise step). Gradients are set to None by
`zero_grad` and SGD without momentum keeps no state, so the figures are the model alone.
W4A16 on every linear but lm_head, AQN on the norms (apply_during "train"), tied embeddings.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

import qtransform
from qtransform.core.noise import NoiseModule
from qtransform.passes import FakeQuantize

MIB = 2**20


def model(hidden: int, layers: int) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def held(m: torch.nn.Module) -> tuple[float, float]:
    """(parameters' local bytes, inserted modules' tensors' bytes) in MiB."""
    params = sum(_bytes(p.to_local() if hasattr(p, "to_local") else p) for p in m.parameters())
    inserted = sum(_bytes(vars(x)) for x in m.modules() if isinstance(x, (FakeQuantize, NoiseModule)))
    return params / MIB, inserted / MIB


def measure(args: argparse.Namespace, wrap: str) -> dict[str, tuple[float, float]]:
    policy = {"version": 1,
              "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": args.format}],
              "noise": {"targets": ["RMSNorm"], "apply_during": "train", "schedule": {
                  "kind": "constant", "sigma_start": 0.01, "num_stages": 2, "total_steps": 2}}}
    net = qtransform.transform(model(args.hidden, args.layers), policy).train()
    noise = qtransform.noise_controller(net)
    runner: torch.nn.Module = net
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net.model.layers:
            fully_shard(layer)
        fully_shard(net)
    elif wrap == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    ids = torch.randint(0, 8192, (1, 64), generator=torch.Generator().manual_seed(0))
    out = {"before step": held(net)}
    loss = runner(input_ids=ids, labels=ids).loss
    out["after forward"] = held(net)
    loss.backward()
    opt.step()
    opt.zero_grad()
    noise.step()
    out["after step"] = held(net)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, wrap: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        result = measure(args, wrap)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def spawn(world: int, args: argparse.Namespace, wrap: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, port, args, wrap, out), nprocs=world)
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--format", default="nvfp4")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {"1 process, no wrapper": [measure(args, "none")]}
    for world in (1, 2):
        runs[f"FSDP2, {world} rank{'s' if world > 1 else ''}"] = spawn(world, args, "fsdp2")
    runs["DDP, 2 ranks"] = spawn(2, args, "ddp")
    print(f"Qwen2 hidden {args.hidden}, {args.layers} layers, {args.format} W4A16 + AQN; MiB per rank "
          "(rank 0; every rank shown where they differ): parameters / inserted modules")
    print("| run | before step | after forward | after step |")
    print("|---|---|---|---|")
    for name, ranks in runs.items():
        cells = []
        for point in ("before step", "after forward", "after step"):
            values = sorted({r[point] for r in ranks})
            cells.append(" or ".join(f"{p:.2f} / {i:.2f}" for p, i in values))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
