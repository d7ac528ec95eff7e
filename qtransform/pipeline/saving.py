"""Saving a transformed model so that it reloads.

A transformed model is the original weights plus a policy: fake-quant, taps and noise are nodes,
never written into the weights. So a saved transformed model is a normal `save_pretrained`
folder (the original, full-precision weights, loadable by any transformers code) with the policy
beside it; `load_transformed` rebuilds the transformed model from the two.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from qtransform.core import io as qio
from qtransform.errors import UserError
from qtransform.models import load_model
from qtransform.pipeline.transform import PolicyLike, transform
from qtransform.schemas import dump_policy, load_policy

POLICY_FILE = "qtransform_policy.json"


def save_transformed(model: nn.Module, policy: PolicyLike, out_dir: str | os.PathLike, *,
                     force: bool = False) -> Path:
    """Write `save_pretrained` output plus the policy to `out_dir`, atomically as a folder.

    `out_dir` may be absent, empty or a previous `save_transformed` output; any other folder is
    refused unless `force` (see `qtransform.core.io.output_folder`).
    """
    with qio.output_folder(out_dir, "transform", force=force) as staging:
        write_transformed(model, policy, staging)
    return Path(out_dir)


def write_transformed(model: nn.Module, policy: PolicyLike, folder: Path) -> None:
    """The files of a saved transformed model, into an existing (staging) folder."""
    if not hasattr(model, "save_pretrained"):
        raise UserError(f"{type(model).__name__} has no save_pretrained; save its state_dict and policy")
    model.save_pretrained(folder)
    qio.write_json(folder / POLICY_FILE, dump_policy(load_policy(policy)))


def load_transformed(folder: str | os.PathLike) -> nn.Module:
    """Reload a folder written by `save_transformed`: the weights, transformed by its policy."""
    path = Path(folder)
    if not (path / POLICY_FILE).exists():
        raise UserError(f"{path}: no {POLICY_FILE}; was it written by `qtransform transform`?")
    return transform(load_model(path), path / POLICY_FILE, inplace=True)
