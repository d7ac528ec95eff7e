"""FP8 (E4M3, E5M2) elements with a plain fp32 scale at any granularity.

What the RL and serving stacks roll out with: one scale per tensor, per channel (weights) with
per-token dynamic activations, 128x128 weight tiles with 1x128 activation groups. The numbers
are compressed-tensors' (scale = amax / max_normal, zero scale -> eps, x / scale clamped to
+-max_normal and rounded to nearest even, times the scale); see `scaled.py`.
"""

from __future__ import annotations

from qtransform.formats.registry import (
    E4M3,
    E5M2,
    GRANULARITIES,
    ROUNDINGS,
    SCALE_DTYPES,
    Family,
    FormatSpec,
    register,
    register_family,
)
from qtransform.formats.scaled import quantize_scaled

FP8 = register_family(Family(
    "fp8", {"rounding": ROUNDINGS, "scale_dtype": SCALE_DTYPES},
    quantize=lambda blocks, cfg, u, amax_t: quantize_scaled(
        blocks, cfg, u, amax_t, cfg.spec.element, cfg.spec.max_normal,
        -cfg.spec.max_normal, cfg.spec.max_normal),
    scale_values=lambda scales, tensor_scale, cfg: scales,
    per_tensor=lambda cfg: cfg.granularity == "tensor", granularities=GRANULARITIES,
    kernel_id=2,  # the C kernel's integer-family plan (scale = amax / qmax) on a float grid
))
for _elem in (E4M3, E5M2):
    register(FormatSpec(
        name=f"fp8_{_elem.name}", family=FP8, element=_elem, default_block=128, scale="fp32",
        tile=(128, 128), onnx_op=f"FP8{_elem.name.upper()}FakeQuant", allowed_blocks=None,
        description=f"FP8 {_elem.name.upper()} with an fp32 scale (amax / {_elem.max_normal:g}) "
                    "per tensor, channel, token, group or tile",
    ))
