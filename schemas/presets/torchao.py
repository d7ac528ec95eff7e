"""torchao's MXFP8 training recipes (`torchao.prototype.moe_training.config.MXFP8TrainingRecipe`) as
qtransform policies: what `MXFP8Linear` / `mx_mm` compute in the three GEMMs of a Linear.

Read from torchao 0.18.0 (`prototype/moe_training/mxfp8_linear.py`, `prototype/mx_formats/mx_tensor.py`
`to_mx` and `_to_mx_rceil`) and checked bit for bit on CPU against its emulated kernels
(`KernelPreference.EMULATED`: each operand quantized, dequantized to the input dtype, `torch.mm`),
which compute what its GPU kernels compute: tests/training/test_training_presets.py.

- forward: X and W in MXFP8 E4M3 blocks of 32 along the input features;
- dgrad: G along the output features, W along the output features (a second copy, from the
  high-precision W);
- wgrad: G and X along the tokens, both from high precision; MXFP8_RCEIL_WGRAD_WITH_HP computes
  wgrad from the unquantized G and X instead (`grad_wgrad: null`, no input role);
- E8M0 scales `2^ceil(log2(amax / 448))` (ScaleCalculationMode.RCEIL, qtransform's `rceil`).
"""

from __future__ import annotations

from typing import Any

from . import Preset, register_preset

STACK = "torchao"
VERSION = "torchao 0.18.0 (its emulated MXFP8 kernels on CPU)"
TARGETS = ["Linear"]
IGNORE = ["re:lm_head"]  # torchtitan's MXFP8 converter leaves the output projection in high precision
MXFP8 = {"format": "mxfp8_e4m3", "block_size": 32, "scale_rule": "rceil"}


def recipe_preset(recipe: str, what: str, wgrad_with_hp: bool = False) -> Preset:
    roles: dict[str, Any] = {"grad": dict(MXFP8), "weight": dict(MXFP8)}
    roles |= {"grad_wgrad": None} if wgrad_with_hp else {"input": dict(MXFP8)}
    rule = {"name": f"{STACK}/{recipe} weights and inputs", "targets": list(TARGETS), "ignore": list(IGNORE),
            "tensors": ["weight", "input"], **MXFP8, "backward": "quantized", "backward_roles": roles}
    return register_preset(Preset(
        name=f"{STACK}/{recipe}",
        reproduces=f"torchao's {recipe} MXFP8 training recipe ({what}) on every Linear but lm_head",
        checked_against=VERSION,
        content={"quantize": [rule]},
    ))


MXFP8_RCEIL = recipe_preset("MXFP8_RCEIL", "every GEMM operand in MXFP8 E4M3 along its reduction axis")
MXFP8_RCEIL_WGRAD_WITH_HP = recipe_preset(
    "MXFP8_RCEIL_WGRAD_WITH_HP", "forward and dgrad in MXFP8 E4M3, wgrad in high precision", wgrad_with_hp=True)
