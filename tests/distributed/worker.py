"""Training runs for tests/distributed/test_distributed.py: one function trains a transformed tiny Qwen2 a few
SGD steps in a single process, or on one rank of a gloo group under FSDP2 or DDP; the test
compares what every rank returns with the single-process run, bit for bit.

Every rank gets the same batch, so the averaged gradient of a data-parallel step is (g + g) / 2
= g exactly, and the only way a rank can differ from the single process is qtransform (or the
wrapper) computing something else.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import qtransform
from qtransform.core.backward import BackwardLinear
from qtransform.core.noise import NoiseModule
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.passes import FakeQuantize, Rotate

STEPS = 3
VOCAB = 97  # odd: FSDP2 pads the embedding's shards (uneven dim 0)
LINEAR = {"targets": ["Linear"], "ignore": ["lm_head"]}
NOISY = {"kind": "constant", "sigma_start": 0.05, "num_stages": 2, "total_steps": 2}  # step >= 1
POLICIES: dict[str, dict[str, Any]] = {
    "nvfp4_w": {"quantize": [{**LINEAR, "format": "nvfp4"}]},
    "mxfp4_w4a4": {"quantize": [{**LINEAR, "format": "mxfp4", "tensors": ["weight", "input"]}]},
    # fused q/k/v and gate/up global scales (sharded: read from every member in the forward),
    # per-token activation global scales
    "nvfp4_fused_w4a4": {"quantize": [{**LINEAR, "format": "nvfp4", "tensors": ["weight", "input"],
                                       "share_scale": "fused"}]},
    "outputs_stochastic": {"quantize": [
        {**LINEAR, "format": "mxfp4", "rounding": "stochastic", "seed": 5},
        {**LINEAR, "format": "nvfp4", "tensors": ["output"], "name": "out"}]},
    "aqn_hw_error": {
        "quantize": [{**LINEAR, "format": "nvfp4"}],
        "noise": {"targets": ["RMSNorm"], "schedule": NOISY, "apply_during": "train", "seed": 7},
        "hw_error": {**LINEAR, "error_scale": 0.02, "seed": 3}},
    "aqn_forward_rollout": {
        "quantize": [{**LINEAR, "format": "mxfp4"}],
        "noise": {"targets": ["RMSNorm"], "schedule": NOISY, "resample": "forward", "apply_during": "both"},
        "hw_error": {**LINEAR, "error_type": "absolute_gaussian", "error_scale": 0.01,
                     "injection_point": "input", "apply_during": "train"}},
    # the backward GEMMs quantized per role (Transformer Engine's NVFP4 recipe: stochastic
    # gradient rounding, the forward's weight, a random Hadamard on wgrad), and high precision
    "nvfp4_backward_quantized": {"quantize": [{
        **LINEAR, "format": "nvfp4", "tensors": ["weight", "input"], "backward": "quantized",
        "backward_roles": {"grad": {"format": "nvfp4", "rounding": "stochastic", "seed": 3},
                           "weight": "forward", "input": {"format": "nvfp4"}},
        "wgrad_hadamard": {"block_size": 16}}]},
    "mxfp8_backward_high_precision": {"quantize": [{
        **LINEAR, "format": "mxfp8_e4m3", "tensors": ["weight", "input"], "backward": "high_precision"}]},
    # a random Hadamard rotation before MXFP4 W4A4: the rotated weight is recomputed
    # in every sharded forward and kept by nobody
    "rotated_w4a4": {"rotate": [{**LINEAR, "kind": "random_hadamard", "block_size": 32, "seed": 4}],
                     "quantize": [{**LINEAR, "format": "mxfp4", "tensors": ["weight", "input"]}]},
}
WRAPS = ("fsdp", "fsdp_no_reshard", "fsdp_checkpointing", "ddp", "ddp_checkpointing")


def tiny_qwen2() -> nn.Module:
    return build_tiny("qwen2", vocab=VOCAB).train()  # built as training code builds it


def held_elements(model: nn.Module) -> int:
    """Elements of every tensor the inserted modules keep (attributes, buffers, containers)."""
    def count(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel()
        if isinstance(value, dict):
            return sum(count(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(count(v) for v in value)
        return 0
    return (sum(count(vars(m)) for m in model.modules() if isinstance(m, (FakeQuantize, NoiseModule, BackwardLinear)))
            + sum(count(m._cached) for m in model.modules() if isinstance(m, Rotate)))  # its operand is a constant


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(policy_name: str, wrap: str | None) -> dict[str, Any]:
    """Transform, warm the weight cache with one eval forward, wrap (or not), train STEPS steps.

    Returns the losses, the full updated parameters, what the inserted modules hold after the
    last step and the rollout weights, all gathered where the model is sharded, and the error
    `transform` raised when given the wrapped model."""
    policy = {"version": 1, **POLICIES[policy_name]}
    model = qtransform.transform(tiny_qwen2(), policy)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.eval()(input_ids=ids)  # fills the weight cache before any sharding
    noise = qtransform.noise_controller(model) if "noise" in policy or "hw_error" in policy else None
    model.train()
    if wrap and wrap.endswith("checkpointing"):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    runner: nn.Module = model
    if wrap and wrap.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        reshard = wrap != "fsdp_no_reshard"
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    elif wrap and wrap.startswith("ddp"):
        runner = nn.parallel.DistributedDataParallel(model)
    refused = None
    if wrap:  # transforming the wrapped model is a user mistake with a fix
        try:
            qtransform.transform(runner, policy)
        except UserError as error:
            refused = str(error)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = runner(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if noise is not None:
            noise.step()
        losses.append(loss.item())
    held = held_elements(model)
    params = {name: _full(p) for name, p in model.named_parameters()}
    rollout = {name: t.clone() for name, t in qtransform.rollout_weights(runner)}
    return {"losses": losses, "params": params, "held": held, "rollout": rollout, "refused": refused}


def worker(rank: int, world: int, port: int, jobs: list[tuple[str, str]], out: str) -> None:
    """One rank: every (policy, wrap) job in order, results saved to `out/rank<r>.pt`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        results = {job: train(*job) for job in jobs}
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out) / f"rank{rank}.pt")
