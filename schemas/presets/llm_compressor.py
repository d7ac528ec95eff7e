"""llm-compressor's preset schemes (compressed-tensors `PRESET_SCHEMES`) as qtransform policies.

Each preset reproduces the model that `oneshot(model, recipe=QuantizationModifier(targets="Linear",
scheme=S, ignore=["lm_head"]))` leaves in memory, logit for logit (tests_llmc/ checks it against
llm-compressor itself; docs/recipes.md lists what each rule must match and why):

- scales in the model's dtype (`scale_dtype: "input"`), integers on compressed-tensors' full range
  (`int_range: "full"`: amax/7.5, amax/127.5), MX exponents by `scale_rule: "even"`, NVFP4 in
  compressed-tensors' order of operations with q/k/v and gate/up sharing a global scale;
- static activation scales (FP8, NVFP4's global scale) from `static_minmax` over the calibration
  batches, run on the full-precision model with eager attention, as llm-compressor calibrates.

Every rule with 1D groups declares compressed-tensors' constraint that they divide the input
features (`GROUPS`): llm-compressor refuses a Linear whose input features its groups do not divide,
and so does transform with this preset (`qtransform.pipeline.constraints`).
"""

from __future__ import annotations

from typing import Any

from qtransform.checkpoints.matching import ct_entry

from . import Constraint, Preset, register_preset

STACK = "llm-compressor"
VERSION = "llmcompressor 0.14.0.1 with compressed-tensors 0.19"
TARGETS = ["Linear"]
IGNORE = ["lm_head"]  # the examples' ignore list for dense models
CALIBRATION = {"attention": "eager"}  # llm-compressor's calibration_forward_context

NVFP4 = {"format": "nvfp4", "nvfp4_variant": "compressed-tensors", "scale_dtype": "input"}
MXFP4 = {"format": "mxfp4", "scale_rule": "even"}
FP8 = {"format": "fp8_e4m3", "scale_dtype": "input"}
STATIC = {"scale_source": "static", "observer": "static_minmax"}
# the stack's words when a group does not divide a Linear's input features: llm-compressor checks
# weight groups before it quantizes; activation groups fail in compressed-tensors' forward
GROUPS = {"weight": "llm-compressor refuses it: group and tensor-group quantization require "
                    "columns % group_size == 0; compressed-tensors will error when saving or "
                    "running forward",
          "input": "compressed-tensors' forward fails on it: its dynamic activation groups "
                   "cannot split the input features (unflatten ... don't multiply up)"}


def rule(scheme: str, tensor: str, **fields: Any) -> dict[str, Any]:
    """One named quantize rule of a scheme, with llm-compressor's targets and ignore list."""
    part = {"weight": "weights", "input": "inputs"}[tensor]
    return {"name": f"{STACK}/{scheme} {part}",
            "targets": [ct_entry(t) for t in TARGETS],
            "ignore": [ct_entry(i) for i in IGNORE],
            "tensors": [tensor], **fields}


def scheme_preset(scheme: str, what: str, rules: list[dict[str, Any]], calibrated: bool = False) -> Preset:
    content: dict[str, Any] = {"quantize": rules}
    if calibrated:
        content["calibration"] = dict(CALIBRATION)
    grouped = [r for r in rules if "granularity" not in r]  # 1D groups (2D blocks it pads)
    return register_preset(Preset(
        name=f"{STACK}/{scheme}",
        reproduces=f"llm-compressor's {scheme} scheme ({what}) on every Linear but lm_head",
        checked_against=VERSION,
        content=content,
        constraints=tuple(Constraint(r["name"], "groups_divide", GROUPS[r["tensors"][0]])
                          for r in grouped),
    ))


NVFP4A16 = scheme_preset("NVFP4A16", "NVFP4 weights with q/k/v and gate/up global scales fused, "
                         "16-bit activations", [
    rule("NVFP4A16", "weight", **NVFP4, share_scale="fused"),
])
scheme_preset("NVFP4", "NVFP4 weights with fused global scales, NVFP4 activations with a "
              "calibrated global scale and dynamic 16-element block scales", [
    rule("NVFP4", "weight", **NVFP4, share_scale="fused"),
    rule("NVFP4", "input", **NVFP4, **STATIC),
], calibrated=True)
scheme_preset("MXFP4A16", "MXFP4 weights, 16-bit activations", [
    rule("MXFP4A16", "weight", **MXFP4),
])
scheme_preset("MXFP4", "MXFP4 weights and dynamic MXFP4 activations", [
    rule("MXFP4", "weight", **MXFP4),
    rule("MXFP4", "input", **MXFP4),
])
scheme_preset("FP8", "FP8 E4M3 weights per tensor, activations per tensor with a calibrated scale", [
    rule("FP8", "weight", **FP8, granularity="tensor"),
    rule("FP8", "input", **FP8, granularity="tensor", **STATIC),
], calibrated=True)
scheme_preset("FP8_DYNAMIC", "FP8 E4M3 weights per output channel, dynamic per-token activations", [
    rule("FP8_DYNAMIC", "weight", **FP8, granularity="channel"),
    rule("FP8_DYNAMIC", "input", **FP8, granularity="token"),
])
scheme_preset("FP8_BLOCK", "FP8 E4M3 weights in 128x128 tiles, dynamic activations in groups of 128", [
    rule("FP8_BLOCK", "weight", **FP8, granularity="tile", block_shape=[128, 128]),
    rule("FP8_BLOCK", "input", **FP8, block_size=128),
])
scheme_preset("W4A16", "int4 weights in groups of 128, 16-bit activations", [
    rule("W4A16", "weight", format="int4", block_size=128, int_range="full", scale_dtype="input"),
])
scheme_preset("W8A8", "int8 weights per output channel, dynamic per-token int8 activations", [
    rule("W8A8", "weight", format="int8", granularity="channel", int_range="full", scale_dtype="input"),
    rule("W8A8", "input", format="int8", granularity="token", int_range="full", scale_dtype="input"),
])


def kv_preset(name: str, strategy: str, granularity: str) -> Preset:
    """A `kv_cache_scheme` alone (FP8 E4M3, symmetric, static): to be listed after a weight
    preset (`"preset": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"]`). K and V after
    RoPE, every token as the cache holds it; the query and the probabilities stay unquantized.
    Scales from llm-compressor's default observer for K/V (the moving average `minmax`, measured:
    not the `static_minmax` of Linear inputs), computed in the model's dtype."""
    return register_preset(Preset(
        name=f"{STACK}/{name}",
        reproduces=f"llm-compressor's kv_cache_scheme FP8 with strategy {strategy!r} (keys and "
                   "values after RoPE, static scales, queries unquantized) on every attention",
        checked_against=VERSION,
        content={"quantize": [{"name": f"{STACK}/{name} key/value", "targets": ["Attention"],
                               "tensors": ["key", "value"], **FP8, "granularity": granularity,
                               "scale_source": "static", "observer": "minmax"}],
                 "calibration": dict(CALIBRATION)},
    ))


kv_preset("KV_FP8", "tensor", "tensor")
kv_preset("KV_FP8_ATTN_HEAD", "attn_head", "head")
