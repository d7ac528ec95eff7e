"""Where rotations enter a checkpoint: compressed-tensors' `transform_config`.

The hook point for the rotations issue (qtransform/export/rotation_config.py,
`transform_config(policy, program)`): today no rotation pass exists to describe, so there is
nothing to write and this returns None; the merge that brings the rotate pass wires it here.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def rotation_config(model: nn.Module) -> dict[str, Any] | None:
    """compressed-tensors' `transform_config` of the rotations `model` runs, or None."""
    del model
    return None
