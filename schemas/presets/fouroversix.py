"""transformers' `FourOverSixConfig` (quant_method "fouroversix", transformers 5.23,
its `utils/quantization_config.py` and its fouroversix integration module, which passes its fields to
mit-han-lab/fouroversix's `ModelQuantizationConfig`) as a qtransform policy, in transformers' words.

Read from fouroversix dadfad6 (`quantize/pytorch/reference.py`: `quantize`, `select_fouroversix`,
`compute_nv_scale_factors`; `utils.py`: the scale bound): every Linear but `modules_to_not_convert`
(lm_head) quantizes its weight and its input to NVFP4 (`dtype` "nvfp4"), each with the tensor's own
amax (`x.abs().max()`, a whole activation per call: `global_scale: "tensor"`), blocks of 16 along
the input features, four over six by `scale_rule` in the library's order
(`four_over_six_order: "fouroversix"`, its E4M3 bound 256: `global_bound: 256`).

Not modelled (refused by the options' choices): scale rules `abs_max`, `static_6` and `static_4`,
`weight_scale_2d` (16x16 weight blocks), `dtype` "mxfp4", the CUDA/Triton backends' arithmetic and
the GEMM's own output rounding (`output_dtype`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import Preset, PresetOption, register_preset

STACK = "transformers"
NAME = f"{STACK}/FourOverSix"
RULES = ("mse", "mae")  # the scale rules four_over_six computes in the library's order


def build(o: Mapping[str, Any]) -> dict[str, Any]:
    """The weight and input rules of FourOverSixConfig(**o)."""
    def rule(tensor: str, scale_rule: str, **extra: Any) -> dict[str, Any]:
        return {"name": f"{NAME} {tensor}s", "targets": ["Linear"], "ignore": ["re:lm_head"],
                "tensors": [tensor], "format": "nvfp4", "four_over_six": scale_rule,
                "four_over_six_order": "fouroversix", "global_bound": 256, **extra}
    return {"quantize": [
        rule("weight", o["weight_scale_rule"] or o["scale_rule"]),
        rule("input", o["activation_scale_rule"] or o["scale_rule"], global_scale="tensor"),
    ]}


OPTIONS = (
    PresetOption("scale_rule", "mse", "scale_rule: how each block picks max/6 or max/4, by squared "
                 "('mse') or absolute ('mae') error (abs_max, static_6, static_4 are not modelled)",
                 choices=RULES),
    PresetOption("weight_scale_rule", None, "weight_scale_rule: scale_rule for the weights (null: "
                 "scale_rule)", choices=(None, *RULES)),
    PresetOption("activation_scale_rule", None, "activation_scale_rule: scale_rule for the inputs "
                 "(null: scale_rule)", choices=(None, *RULES)),
    PresetOption("weight_scale_2d", False, "weight_scale_2d: false only (16x16 weight blocks have no "
                 "four-over-six rule here)", choices=(False,)),
)

FOUR_OVER_SIX = register_preset(Preset(
    name=NAME,
    reproduces="transformers' FourOverSixConfig (the fouroversix library's PyTorch reference): NVFP4 "
               "weights and inputs with four over six by scale_rule, on every Linear but lm_head",
    checked_against="fouroversix dadfad6 (a port of its reference, tests/formats/stack_fouroversix.py)",
    content=build({o.name: o.default for o in OPTIONS}),
    options=OPTIONS,
    build=build,
))
