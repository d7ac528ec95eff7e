"""A rollout engine without the engine: what vLLM computes serving a quantized checkpoint, simulated.

The engine side of a parity report is then the checkpoint the trainer's policy deploys (its
export, or the quantized folder itself) opened as the engine runs it:
`checkpoint_policy(model, engine="vllm", backend=...)`, its KV cache writer and attention kernel,
and on the cpu backend its quantized-linear kernels (docs/engines.md). No vLLM process runs; the
gap to the trainer is what the deployment stack computes differently from the fake quantization.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qtransform.core import engines
from qtransform.errors import UserError
from qtransform.models import checkpoint_policy, load_model
from qtransform.pipeline import transform
from qtransform.rl.parity import HFEngine


def simulated_engine(source: nn.Module | str | os.PathLike, *, engine: str = "vllm",
                     backend: str = "auto", dtype: torch.dtype | None = None) -> HFEngine:
    """`engine` on `backend` serving a quantized checkpoint, simulated: the folder (opened in
    `dtype`, default its own) or a model `load_model` opened from one (not changed).

    Example:
        >>> qtransform.export_checkpoint(model, "ckpt")   # model: the trainer, transformed
        >>> report = parity(model, simulated_engine("ckpt", backend="cpu"), prompts)
    """
    if engine not in engines.ENGINES:
        raise UserError(f"engine {engine!r}: choose one of {', '.join(engines.ENGINES)}")
    opened = source if isinstance(source, nn.Module) else load_model(source, dtype=dtype)
    policy = checkpoint_policy(opened, engine=engine, backend=backend)
    if policy is None:
        raise UserError(f"{source if not isinstance(source, nn.Module) else 'the model'}: not a "
                        "quantized checkpoint, so nothing for the engine to run differently; "
                        "export the trainer's model (qtransform.export_checkpoint) and give the folder")
    resolved = policy.get("engine", {}).get("backend", backend)
    return HFEngine(transform(opened, policy).eval(), name=f"{engine} {resolved} (simulated)")
