"""llm-compressor's preset schemes (compressed-tensors `PRESET_SCHEMES`) as qtransform policies.

Each preset reproduces the model that `oneshot(model, recipe=QuantizationModifier(targets="Linear",
scheme=S, ignore=["lm_head"]))` leaves in memory, logit for logit (tests_llmc/ checks it against
llm-compressor itself). The numerics each rule must match are in docs/recipes.md.
"""

from __future__ import annotations

from typing import Any

from . import Preset, register_preset
from .patterns import from_llm_compressor

STACK = "llm-compressor"
VERSION = "llmcompressor 0.14.0.1 with compressed-tensors 0.19"
TARGETS = ["Linear"]
IGNORE = ["lm_head"]  # the examples' ignore list for dense models


def rule(scheme: str, part: str, **fields: Any) -> dict[str, Any]:
    """One named quantize rule of a scheme, with llm-compressor's targets and ignore list."""
    return {"name": f"{STACK}/{scheme} {part}",
            "targets": [from_llm_compressor(t) for t in TARGETS],
            "ignore": [from_llm_compressor(i) for i in IGNORE], **fields}


def scheme_preset(scheme: str, what: str, rules: list[dict[str, Any]]) -> Preset:
    return register_preset(Preset(
        name=f"{STACK}/{scheme}",
        reproduces=f"llm-compressor's {scheme} scheme ({what}) on every Linear but lm_head",
        checked_against=VERSION,
        content={"quantize": rules},
    ))


NVFP4A16 = scheme_preset("NVFP4A16", "NVFP4 weights, 16-bit activations", [
    rule("NVFP4A16", "weights", format="nvfp4", tensors=["weight"],
         nvfp4_variant="compressed-tensors"),
])
