"""Saving a transformed model so that it reloads.

A transformed model is the original weights plus a policy: fake-quant, taps and noise are nodes,
never written into the weights. So a saved transformed model is a normal `save_pretrained`
folder (the original, full-precision weights, loadable by any transformers code) with the policy
beside it; `load_transformed` rebuilds the transformed model from the two.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from torch import nn

from qtransform.errors import UserError
from qtransform.models import load_model
from qtransform.pipeline.transform import PolicyLike, transform
from qtransform.schemas import dump_policy, load_policy

POLICY_FILE = "qtransform_policy.json"


def save_transformed(model: nn.Module, policy: PolicyLike, out_dir: str | os.PathLike) -> Path:
    """Write `save_pretrained` output plus the policy to `out_dir`, atomically as a folder."""
    out = Path(out_dir)
    if not hasattr(model, "save_pretrained"):
        raise UserError(f"{type(model).__name__} has no save_pretrained; save its state_dict and policy")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        model.save_pretrained(tmp)
        (tmp / POLICY_FILE).write_text(json.dumps(dump_policy(load_policy(policy)), indent=2))
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_transformed(folder: str | os.PathLike) -> nn.Module:
    """Reload a folder written by `save_transformed`: the weights, transformed by its policy."""
    path = Path(folder)
    if not (path / POLICY_FILE).exists():
        raise UserError(f"{path}: no {POLICY_FILE}; was it written by `qtransform transform`?")
    return transform(load_model(path), path / POLICY_FILE, inplace=True)
