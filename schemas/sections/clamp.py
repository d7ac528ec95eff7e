"""The `clamp` section: saturate a point of the selected sites to ±limit.

What a narrow accumulator or an FP8 cast of an activation does to values beyond its range (448
for E4M3): the values are clipped, the rest pass unchanged. Gradients are zero where a value was
clipped, as for any clamp.
"""

from __future__ import annotations

from pydantic import Field

from ..base import PosFloat, Selected, Tensor
from ..words import TENSOR_WORDS, describe_selector
from . import Section, register_section


class ClampSpec(Selected):
    """Clamp the `point` of the selected sites to [-limit, limit]."""

    limit: PosFloat = Field(description="largest magnitude kept, e.g. 448 (FP8 E4M3)")
    point: Tensor = Field("output", description="the point clamped: weight, input or output")


def describe(spec: ClampSpec) -> list[str]:
    return [f"Clamp: the {TENSOR_WORDS[spec.point]} of {describe_selector(spec).rstrip(',')} are "
            f"clamped to ±{spec.limit:g}."]


def summary(spec: ClampSpec) -> str:
    return f"clamp ({spec.point} to ±{spec.limit:g})"


register_section(Section("clamp", ClampSpec | None, None, describe, summary, order=4,
                         description="saturate a point of the selected sites to ±limit",
                         example={"targets": ["*.k_proj"], "limit": 2.0}))
