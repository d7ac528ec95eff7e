"""FP8 with a plain fp32 scale in ONNX: the shared body of `scaled.py` with a saturating
float8 rounding. No QDQ form (yet): function and inline modes."""

from __future__ import annotations

from qtransform.export.families.scaled import scaled_blocks
from qtransform.export.functions import Body, OnnxFamily, register_onnx_family
from qtransform.formats.options import QuantConfig


def fp8_blocks(b: Body, x: str, axes: str, cfg: QuantConfig, amax_t: str | None = None) -> str:
    """quantize_scaled with divisor and clamp at the element's max normal."""
    m = cfg.spec.max_normal
    return scaled_blocks(b, x, axes, cfg, cfg.spec.element, m, -m, m, amax_t)


register_onnx_family("fp8", OnnxFamily(fp8_blocks))
