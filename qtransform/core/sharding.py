"""Data-parallel wrappers as qtransform sees them: which modules FSDP shards, which models are
wrapped already.

Under FSDP2 (`fully_shard`) a module's parameter slot holds a DTensor shard between forwards and
an all-gathered full tensor only during its forward (and backward). Anything an inserted module
keeps from one forward to the next (a cached quantized weight, a noise draw the size of the
weight) would be a full-size copy on every rank, which is what sharding exists to avoid; so
inserted modules ask `sharded(self)` and keep nothing when it is true. FSDP (both the composable
`fully_shard` and the `FullyShardedDataParallel` wrapper) marks every module it manages, the
modules under a sharded layer included, with `_is_fsdp_managed_module`; torch.compile reads the
same mark. Inserted modules are children of their site module, so they carry the mark as soon as
the user shards the layer around them.
"""

from __future__ import annotations

import torch
from torch import nn

from qtransform.errors import UserError

FSDP_MARK = "_is_fsdp_managed_module"


def sharded(module: nn.Module) -> bool:
    """Whether FSDP manages `module` (its site's parameters are sharded between forwards)."""
    return bool(module.__dict__.get(FSDP_MARK, False))


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor  # 0.6 s to import; only where distributed exists

    return isinstance(t, DTensor)


def check_unwrapped(model: nn.Module) -> None:
    """Refuse a model already wrapped for data parallelism: qtransform transforms the model,
    then the user shards or wraps the result (the order verl, TRL and torchtitan use)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise UserError("the model is wrapped in DistributedDataParallel: transform the model "
                        "first, then wrap the transformed model in DDP")
    if any(sharded(m) for m in model.modules()) or any(_is_dtensor(p) for p in model.parameters()):
        raise UserError("the model is sharded (FSDP / fully_shard, DTensor parameters): "
                        "transform the unsharded model first, then call fully_shard on the "
                        "transformed model (see docs/scale.md)")

