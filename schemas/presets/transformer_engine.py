"""NVIDIA Transformer Engine's training recipes (`transformer_engine.common.recipe`) as qtransform
policies: what `te.autocast(recipe=R)` computes in the three GEMMs of every TE Linear.

Read from Transformer Engine main (d0067d0, 2026-08): `common/recipe/__init__.py` (the recipes, their
switches and `NVTE_*` variables), `pytorch/custom_recipes/reference_nvfp4.py` (the Python reference
of the NVFP4 quantizer: order of operations, 2-D tiles, the Hadamard with its fixed signs),
`common/util/ptx_arch_spec.cuh` `float_to_e8m0` (MXFP8's scale) and the NVFP4/MXFP8 user guides
(TransformerEngine/docs/features/low_precision_training/). docs/training.md gives each rule's source line by line.

- NVFP4BlockScaling: E2M1 elements, E4M3 block scales and one fp32 scale per quantized copy, in
  NVIDIA's order (qtransform's default `nvfp4_variant`); weights in 16x16 tiles (one copy serves
  the forward and dgrad), activations and gradients in 1x16 blocks along each GEMM's reduction
  axis with one tensor scale per call; gradients rounded stochastically; the wgrad operands
  (columnwise copies of X and G) rotated along the tokens first by TE's 16x16 random Hadamard
  (its fixed sign vector `RHT_SIGNS`).
- MXFP8BlockScaling: E4M3 (E5M2 gradients with `fp8_format: "HYBRID"`) in blocks of 32, E8M0 scale
  `2^ceil(log2(amax * (1/448)))` (qtransform's `rceil`, equal for every fp32 amax), every copy
  quantized from the high-precision tensor along its GEMM's reduction axis.

Both take `backward_override` (None, "high_precision", "dequantized"): TE's switch to compute the
backward from the original operands, or from the forward's dequantized ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..errors import Issue, problems_error
from . import Preset, PresetOption, register_preset

STACK = "transformer-engine"
VERSION = ""  # read from the sources; Transformer Engine runs its recipes on Blackwell GPUs only
TARGETS = ["Linear"]
IGNORE = ["re:lm_head"]  # TE quantizes its own te.Linear modules; model heads stay nn.Linear
# TE's RHT signs: one fixed vector (pytorch/custom_recipes/reference_nvfp4.py, get_wgrad_sign_vector())
SCOPES = ("none", "weights", "activations", "all")  # TE's _NVFP4_4OVER6_SCOPES
RHT_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
OVERRIDE = PresetOption(
    "backward_override", None, "TE's backward_override / NVTE_BACKWARD_OVERRIDE: null = the quantized "
    "backward, high_precision = the original operands, dequantized = the forward's quantized operands",
    choices=(None, "high_precision", "dequantized"))


def rule(recipe: str, part: str, **fields: Any) -> dict[str, Any]:
    return {"name": f"{STACK}/{recipe} {part}", "targets": list(TARGETS), "ignore": list(IGNORE), **fields}


def backward(override: str | None, quantized: Mapping[str, Any]) -> dict[str, Any]:
    """The backward fields of a recipe's rules under `backward_override`."""
    if override == "high_precision":
        return {"backward": "high_precision"}
    if override == "dequantized":
        return {"backward": "dequantized"}
    return {"backward": "quantized", **quantized}


def nvfp4_block_scaling(o: Mapping[str, Any]) -> dict[str, Any]:
    """NVFP4BlockScaling's rules under its switches `o` (NVFP4BlockScaling.__post_init__'s QParams)."""
    nvfp4 = {"format": "nvfp4", "nvfp4_variant": "default"}
    tiles = not o["disable_2d_quantization"]
    grad: dict[str, Any] = {"format": "nvfp4"}
    if not o["disable_stochastic_rounding"]:
        grad["rounding"] = "stochastic"
    roles = {"grad": grad, "weight": "forward" if tiles else {"format": "nvfp4"}, "input": {"format": "nvfp4"}}
    quantized: dict[str, Any] = {"backward_roles": roles}
    if not o["disable_rht"]:
        quantized["wgrad_hadamard"] = {"kind": "random_hadamard", "block_size": 16, "signs": list(RHT_SIGNS)}
    fos_w, fos_a = four_over_six(o, "weights", tiles), four_over_six(o, "activations", tiles)
    if fos_a:  # each quantizer's columnwise copy is quantized the same way
        roles["input"] = {"format": "nvfp4", **fos_a}
    if fos_w:
        roles["weight"] = {"format": "nvfp4", **fos_w}
    grads = backward(o["backward_override"], quantized)  # both rules of a Linear carry the same
    weights = rule("NVFP4BlockScaling", "weights", tensors=["weight"], **nvfp4, **fos_w,
                   **({"block_shape": [16, 16]} if tiles else {}), **grads)
    inputs = rule("NVFP4BlockScaling", "inputs", tensors=["input"], **nvfp4, **fos_a,
                  global_scale="token" if o["row_scaled_activation"] else "tensor", **copy.deepcopy(grads))
    return {"quantize": [weights, inputs]}


def four_over_six(o: Mapping[str, Any], scope: str, tiles: bool) -> dict[str, Any]:
    """The four-over-six fields of one tensor scope ("weights" or "activations") under TE's
    NVTE_NVFP4_4OVER6 switches (pytorch/quantization.py, `_make`: gradients never; the bound is
    256 where `nvfp4_4over6_e4m3_use_256` covers the scope)."""
    if o["nvfp4_4over6"] not in (scope, "all"):
        return {}
    if scope == "weights" and tiles:
        raise problems_error([Issue(("preset_options", "nvfp4_4over6"), "qtransform's four over "
                                    "six takes 1D blocks, and TE's weights are 16x16 tiles; set "
                                    "disable_2d_quantization true", o["nvfp4_4over6"])])
    if scope == "activations" and not o["disable_rht"]:
        raise problems_error([Issue(("preset_options", "nvfp4_4over6"), "Transformer Engine "
                                    "refuses four over six with RHT on the input quantizer; set "
                                    "disable_rht true", o["nvfp4_4over6"])])
    bound = 256 if o["nvfp4_4over6_e4m3_use_256"] in (scope, "all") else 448
    return {"four_over_six": o["nvfp4_4over6_err_mode"].lower(), "global_bound": bound,
            "four_over_six_order": "transformer-engine"}  # quantize_4over6_nvfp4.cuh's fp32 order


def mxfp8_block_scaling(o: Mapping[str, Any]) -> dict[str, Any]:
    """MXFP8BlockScaling's rules: E4M3 everywhere, or E5M2 gradients (Format.HYBRID)."""
    mxfp8 = {"format": "mxfp8_e4m3", "block_size": 32, "scale_rule": "rceil"}
    grad = {**mxfp8, "format": "mxfp8_e5m2" if o["fp8_format"] == "HYBRID" else "mxfp8_e4m3"}
    roles = {"grad": grad, "weight": dict(mxfp8), "input": dict(mxfp8)}
    return {"quantize": [rule("MXFP8BlockScaling", "weights and inputs", tensors=["weight", "input"], **mxfp8,
                              **backward(o["backward_override"], {"backward_roles": roles}))]}


def recipe_preset(recipe: str, what: str, options: tuple[PresetOption, ...], build: Any) -> Preset:
    defaults = {opt.name: opt.default for opt in options}
    return register_preset(Preset(
        name=f"{STACK}/{recipe}",
        reproduces=f"Transformer Engine's {recipe} training recipe ({what}) on every Linear but lm_head",
        checked_against=VERSION,
        content=build(defaults),
        options=options,
        build=build,
    ))


NVFP4_BLOCK_SCALING = recipe_preset(
    "NVFP4BlockScaling", "NVFP4 forward and backward: 16x16 weight tiles, 1x16 activations and "
    "gradients with one fp32 scale per tensor, stochastically rounded gradients, a 16x16 random "
    "Hadamard on the wgrad operands", (
        PresetOption("disable_rht", False, "NVTE_NVFP4_DISABLE_RHT: no Hadamard on the wgrad operands"),
        PresetOption("disable_stochastic_rounding", False,
                     "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING: gradients rounded to nearest"),
        PresetOption("disable_2d_quantization", False, "NVTE_NVFP4_DISABLE_2D_QUANTIZATION: weights in "
                     "1x16 blocks, a second copy along the output features for dgrad"),
        PresetOption("row_scaled_activation", False, "NVTE_NVFP4_ROW_SCALED_ACTIVATION: one fp32 "
                     "scale per token row of the forward's activations (the wgrad copy keeps one per tensor)"),
        PresetOption("nvfp4_4over6", "none", "NVTE_NVFP4_4OVER6: four over six (per 1x16 block the "
                     "better of the max/6 and max/4 scales) on weights, activations (inputs) or all "
                     "(never gradients)", choices=SCOPES),
        PresetOption("nvfp4_4over6_e4m3_use_256", "all", "NVTE_NVFP4_4OVER6_E4M3_USE_256: the "
                     "four-over-six tensors whose global scale maps the amax to 256, not 448",
                     choices=SCOPES),
        PresetOption("nvfp4_4over6_err_mode", "MAE", "NVTE_NVFP4_4OVER6_ERR_MODE: the error the "
                     "candidates are compared by", choices=("MAE", "MSE")),
        OVERRIDE,
    ), nvfp4_block_scaling)

MXFP8_BLOCK_SCALING = recipe_preset(
    "MXFP8BlockScaling", "MXFP8 E4M3 in blocks of 32 with E8M0 scales, every GEMM operand quantized "
    "from high precision along its reduction axis", (
        PresetOption("fp8_format", "E4M3", "fp8_format: E4M3 everywhere, or HYBRID (E5M2 gradients)",
                     choices=("E4M3", "HYBRID")),
        OVERRIDE,
    ), mxfp8_block_scaling)
