"""FP-Quant's QAT modes (IST-DASLab/FP-Quant, `inference_lib/src/fp_quant`; transformers'
`FPQuantConfig` passes its fields through) as qtransform policies.

Read from FP-Quant at d2e3092: `utils/config.py` (the fields and which combinations are valid),
`module/linear.py` (`FPQuantLinear`: the Hadamard of `hadamard_group_size` from
`scipy.linalg.hadamard(g) / sqrt(g)` on X and W along the input features, the dispatch on
`backward_dtype`), `module/linear_fns.py` (each backward). docs/training.md gives each rule's source
and what is not modelled (QuEST's scale, FP-Quant's own scale and tie rounding, the mxfp4
backward's fresh Hadamard signs per call).

- forward: a `rotate` rule (kind hadamard, block `hadamard_group_size`) on every Linear's input
  axis, then MXFP4 (blocks of 32) or NVFP4 (blocks of 16) on the rotated X and W.
- `backward_dtype` bf16: the backward GEMMs take the unquantized (rotated) operands, rotated back by
  autograd: `backward: "high_precision"`. mxfp8 and mxfp4 (MXFP4 forward only): the gradient
  quantized along each backward GEMM's reduction axis, and the forward's quantized W and X
  requantized along it (`"source": "forward"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import Preset, PresetOption, register_preset

STACK = "fp-quant"
TARGETS = ["Linear"]
IGNORE = ["re:lm_head"]  # FPQuantConfig.modules_to_not_convert defaults to ["lm_head"]
BACKWARD_BLOCK = 32  # FPQuant4x4MasterFn draws 32 signs and views its gradients as (-1, 32)


def rules(forward_dtype: str, o: Mapping[str, Any]) -> dict[str, Any]:
    """The rotate and quantize rules of FPQuantConfig(forward_dtype, **o)."""
    name = f"{STACK}/{forward_dtype}"
    select = {"targets": list(TARGETS), "ignore": list(IGNORE)}
    content: dict[str, Any] = {}
    if o["transform_init"] == "hadamard":
        content["rotate"] = [{"name": f"{name} hadamard", **select, "kind": "hadamard",
                              "block_size": o["hadamard_group_size"]}]
    fields: dict[str, Any] = {"format": forward_dtype}
    dtype = o["backward_dtype"]
    if dtype == "bf16":  # FPQuant4x16MasterFn: grad_output @ weight, grad_outputᵀ @ x
        fields["backward"] = "high_precision"
    elif dtype == "mxfp8":  # FPQuant4x8MasterFn
        # W and X: the forward's MXFP4 copies re-laid as MXFP8 along the other axis
        mxfp8 = {"format": "mxfp8_e4m3", "block_size": 32}
        again = {**mxfp8, "source": "forward"}
        fields |= {"backward": "quantized",
                   "backward_roles": {"grad": mxfp8, "weight": again, "input": dict(again)}}
    else:  # FPQuant4x4MasterFn: the forward's MXFP4 W and X requantized
        mxfp4 = {"format": "mxfp4", "block_size": 32}
        again = {**mxfp4, "source": "forward"}
        fields |= {"backward": "quantized",
                   "backward_roles": {"grad": mxfp4, "weight": again, "input": dict(again)},
                   "dgrad_hadamard": {"kind": "random_hadamard", "block_size": BACKWARD_BLOCK, "seed": 0},
                   "wgrad_hadamard": {"kind": "random_hadamard", "block_size": BACKWARD_BLOCK, "seed": 0}}
    content["quantize"] = [{"name": f"{name} weights and inputs", **select,
                            "tensors": ["weight", "input"], **fields}]
    return content


def options(forward_dtype: str, groups: tuple[int, ...], backwards: tuple[str, ...]) -> tuple[PresetOption, ...]:
    return (
        PresetOption("hadamard_group_size", groups[0], "hadamard_group_size: the block of the Hadamard "
                     "on X and W along the input features", choices=groups),
        PresetOption("backward_dtype", "bf16", "backward_dtype: bf16 = the backward GEMMs in high "
                     "precision; mxfp8 / mxfp4 = gradient and operands quantized" if len(backwards) > 1
                     else f"backward_dtype: FP-Quant allows only bf16 with a {forward_dtype} forward",
                     choices=backwards),
        PresetOption("transform_init", "hadamard", "transform_init: hadamard, or identity (no rotation; "
                     "gsr, a permuted Hadamard, is not modelled)", choices=("hadamard", "identity")),
    )


def fp_quant_preset(forward_dtype: str, groups: tuple[int, ...], backwards: tuple[str, ...]) -> Preset:
    opts = options(forward_dtype, groups, backwards)

    def build(o: Mapping[str, Any]) -> dict[str, Any]:
        return rules(forward_dtype, o)

    return register_preset(Preset(
        name=f"{STACK}/{forward_dtype}",
        reproduces=f"FP-Quant's FPQuantLinear with forward_dtype={forward_dtype}, forward_method=abs_max "
                   "(a Hadamard on X and W along the input features, then "
                   f"{forward_dtype.upper()}) on every Linear but lm_head",
        checked_against="",
        content=build({o.name: o.default for o in opts}),
        options=opts,
        build=build,
    ))


MXFP4 = fp_quant_preset("mxfp4", (32, 64, 128), ("bf16", "mxfp8", "mxfp4"))
NVFP4 = fp_quant_preset("nvfp4", (16, 32, 64, 128), ("bf16",))
