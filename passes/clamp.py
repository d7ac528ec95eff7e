"""Clamp pass: saturate the output (or input, or weight) of selected sites to ±limit.

The smallest pass there is, and the example docs/architecture.md counts files with: this file,
its section `schemas/sections/clamp.py`, and a test. Under export the clamp is a plain ONNX Clip.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qtransform.core.program import Program
from qtransform.core.sites import LINEAR_KINDS
from qtransform.passes.fake_quant import FakeQuantPass
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas.sections.clamp import ClampSpec


class Clamp(nn.Module):
    """x clamped to [-limit, limit]."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def extra_repr(self) -> str:
        return f"limit={self.limit:g}"

    def forward(self, x: Tensor) -> Tensor:
        return torch.clamp(x, -self.limit, self.limit)


@register_pass
class ClampPass(Pass[ClampSpec, ClampSpec]):
    """Inserts `Clamp` at the section's point of every selected site."""

    name = tag = section = "clamp"
    requires = (FakeQuantPass.name,)  # clamps what the (fake-quantized) site computes
    provides = (name,)

    def select(self, program: Program, spec: ClampSpec) -> list[Action[ClampSpec]]:
        return [Action(site, spec.point, "clamp", spec)
                for site in select_sites(program, spec, "clamp", kinds=LINEAR_KINDS)]

    def build(self, program: Program, action: Action[ClampSpec]) -> nn.Module:
        return Clamp(action.payload.limit)

    def describe(self, action: Action[ClampSpec]) -> str:
        return f"±{action.payload.limit:g}"
