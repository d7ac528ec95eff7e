"""Quartet II (arXiv 2601.22813; IST-DASLab/Quartet-II, also shipped in mit-han-lab/fouroversix)
as a qtransform policy: NVFP4 training with an unbiased backward.

Read from IST-DASLab/Quartet-II at 8776a90: `src/models/quantization/schemes/quartet_2.py`
(`Quartet_II_fn`, `rerotate_hadamard`, `eden_1x16s_fp4_kernel`), `src/models/quantization/
quantizers/nvfp4_triton.py` (`rtn_1x16s_fp4_kernel`: the forward, with four over six) and
`kernels/python/quartet2/linear.py` (the CUDA Linear: Hadamard 128, four over six on by default).
docs/recipes.md and docs/training.md give each rule's source and what differs.

- forward: X (one fp32 scale per call) and W in NVFP4 1x16, E2M1 rounded to nearest with ties
  away from zero; with four over six ("mse": per block the better of the max/6 and max/4
  scales, the tensor amax mapped to 256).
- backward: a random Hadamard of `hadamard_dim` with new signs every backward call on both dgrad
  operands (G and the forward's Wᵀ, along the output features) and both wgrad operands (Gᵀ and
  the forward's Xᵀ, along the tokens), each then quantized by the EDEN quantizer (one correction
  per Hadamard group, stochastic E4M3 scales); W and X are the forward's NVFP4 copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import Preset, PresetOption, register_preset

NAME = "quartet-ii/nvfp4"
TARGETS = ["Linear"]
IGNORE = ["re:lm_head"]  # Quartet II's llama builds its blocks' Linears with it, not the head


def rules(o: Mapping[str, Any]) -> dict[str, Any]:
    """The quantize rule of Quartet_II_Linear(hadamard_dim, four_over_six)."""
    group = o["hadamard_dim"]
    eden = {"format": "nvfp4", "eden": {"group": group}}
    again = {**eden, "source": "forward"}  # weight_fp4.T, input_fp4.T: the forward's copies
    rotation = {"kind": "random_hadamard", "block_size": group, "redraw": True}
    forward: dict[str, Any] = {"format": "nvfp4", "nvfp4_variant": "quartet-ii", "rounding": "rna",
                               "global_scale": "tensor"}
    if o["four_over_six"]:
        forward |= {"four_over_six": "mse", "global_bound": 256}
    return {"quantize": [{
        "name": f"{NAME} weights and inputs", "targets": list(TARGETS), "ignore": list(IGNORE),
        "tensors": ["weight", "input"], **forward, "backward": "quantized",
        "backward_roles": {"grad": eden, "weight": again, "input": dict(again)},
        "dgrad_hadamard": dict(rotation), "wgrad_hadamard": dict(rotation)}]}


OPTIONS = (
    PresetOption("four_over_six", True, "four_over_six: the forward's NVFP4 keeps, per block, the "
                 "better (MSE) of the max/6 and max/4 scales, tensor amax to 256 (Quartet_II_linear's "
                 "default; false = plain NVFP4, amax to 448)"),
    PresetOption("hadamard_dim", 128, "hadamard_dim: the backward Hadamard's block and EDEN's "
                 "group (128 in the paper's runs and the CUDA kernels); it must divide every "
                 "Linear's output features", choices=(16, 32, 64, 128)),
)

QUARTET_II = register_preset(Preset(
    name=NAME,
    reproduces="Quartet II's Quartet_II_Linear: an NVFP4 forward (round to nearest, ties away; "
               "four over six) and the EDEN backward (re-drawn random Hadamard, EDEN-corrected "
               "NVFP4 with stochastic E4M3 scales, W and X requantized from the forward's NVFP4) "
               "on every Linear but lm_head",
    checked_against="",
    content=rules({o.name: o.default for o in OPTIONS}),
    options=OPTIONS,
    build=rules,
))
