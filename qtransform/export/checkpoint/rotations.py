"""Where rotations enter a checkpoint: compressed-tensors' `transform_config`.

The hook point for the rotations issue: rot-pass writes qtransform/export/rotation_config.py,
`transform_config(policy, program) -> dict | None` (a UserError when a rotation cannot be
expressed). No rotate pass exists on this branch, so there is nothing to describe and this
returns None; the merge that brings the pass calls `transform_config(policy, program)` here (both
are given when `export_checkpoint` transforms a plain model with a policy; for a model
transformed beforehand `policy` and `program` are None and the policy can be read back from the
inserted modules), and lets `collect` accept the rotate pass's insertions.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from qtransform.core.program import Program


def rotation_config(model: nn.Module, policy: Any = None, program: Program | None = None) -> dict[str, Any] | None:
    """compressed-tensors' `transform_config` of the rotations `model` runs, or None."""
    del model, policy, program
    return None
