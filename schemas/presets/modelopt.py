"""NVIDIA ModelOpt's quantization configs (`mtq.<NAME>`) as qtransform policies.

Each preset is the model that ModelOpt's checkpoint deploys after
`mtq.quantize(model, mtq.<NAME>, forward_loop)` (nvidia-modelopt 0.47, read from its
`configs/ptq/presets/model/*.yaml`, `model_calib.py`, `tensor_quant.py` and `export/`):

- every Linear (fused experts included) but the modules of ModelOpt's default disabled list
  (`DISABLED`, its fnmatch wildcards on quantizer names, translated by `modelopt_entry`): the
  LM head, MoE routers and gates, vision towers, Mamba convolutions, MTP heads;
- static scales come from ModelOpt's max calibration, which observes the FULL-PRECISION model
  (every quantizer collects statistics without quantizing): qtransform's `static_minmax`
  observer on its calibration pass, which runs the model without its fake-quant modules;
- NVFP4 weights of q/k/v and of gate/up share one global scale, the largest amax of the group,
  as ModelOpt's export fuses them (`preprocess_linear_fusion`) for the serving engines.

Each format runs in ModelOpt's own fp32 order of operations (`fp8_variant`, `int_range`,
`nvfp4_variant` "modelopt"), so FP8 and INT4 logits and NVFP4/MXFP8 weights equal ModelOpt's bit
for bit (docs/recipes.md, "ModelOpt presets": how each was checked).
"""

from __future__ import annotations

from typing import Any

from qtransform.checkpoints.matching import modelopt_entry

from . import Preset, register_preset

STACK = "modelopt"
VERSION = "nvidia-modelopt 0.47.0"
TARGETS = ["Linear"]
DISABLED = [  # configs/ptq/units/default_disabled_quantizers.yaml (the name patterns), 0.47.0
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*",
    "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*",
    "*mlp.gate.*", "*mlp.shared_expert_gate.*", "*output_layer*", "*proj_out.*", "*router*",
    "mtp.*", "output.*", "*embed_vision*", "*vision_tower*", "*visual*", "*vision_model*",
    "*multi_modal_projector*",
]
IGNORE = [modelopt_entry(DISABLED)]


def rule(config: str, part: str, **fields: Any) -> dict[str, Any]:
    """One named quantize rule of a config, on ModelOpt's targets minus its disabled modules."""
    return {"name": f"{STACK}/{config} {part}", "targets": list(TARGETS), "ignore": list(IGNORE), **fields}


def config_preset(config: str, what: str, rules: list[dict[str, Any]], version: str = VERSION) -> Preset:
    return register_preset(Preset(
        name=f"{STACK}/{config}",
        reproduces=f"ModelOpt's {config} ({what}) on every Linear but its default disabled modules "
                   "(lm_head, MoE routers and gates, vision towers)",
        checked_against=version,
        content={"quantize": rules},
    ))


NVFP4_DEFAULT_CFG = config_preset(
    "NVFP4_DEFAULT_CFG", "NVFP4 weights with q/k/v and gate/up global scales fused, NVFP4 inputs "
    "with a global scale from max calibration", [
        rule("NVFP4_DEFAULT_CFG", "weights", format="nvfp4", nvfp4_variant="modelopt", tensors=["weight"],
             share_scale="fused"),
        rule("NVFP4_DEFAULT_CFG", "inputs", format="nvfp4", nvfp4_variant="modelopt", tensors=["input"],
             scale_source="static", observer="static_minmax"),
    ])

# after the 0.46 release, in no release yet: NVIDIA/Model-Optimizer at a2fbac7 (2026-08-21), read
NVFP4_FOUR_OVER_SIX_CFG = config_preset(
    "NVFP4_FOUR_OVER_SIX_CFG", "NVFP4 weights whose block amax MSE calibration multiplies by 1.0 "
    "or 1.5 (max/6 or max/4), block scales normalized to 256, q/k/v and gate/up global scales "
    "fused; NVFP4_DEFAULT_CFG's inputs", [
        rule("NVFP4_FOUR_OVER_SIX_CFG", "weights", format="nvfp4", nvfp4_variant="modelopt",
             four_over_six="mse", four_over_six_order="modelopt", global_bound=256,
             tensors=["weight"], share_scale="fused"),
        rule("NVFP4_FOUR_OVER_SIX_CFG", "inputs", format="nvfp4", nvfp4_variant="modelopt",
             tensors=["input"], scale_source="static", observer="static_minmax"),
    ], version="NVIDIA/Model-Optimizer a2fbac7 (from source; a numpy port of its calibration and "
               "export, tests/formats/stack_fouroversix.py)")

FP8_DEFAULT_CFG = config_preset(
    "FP8_DEFAULT_CFG", "FP8 E4M3 weights and inputs, one fp32 scale amax/448 per tensor, input "
    "scales from max calibration", [
        rule("FP8_DEFAULT_CFG", "weights", format="fp8_e4m3", granularity="tensor", fp8_variant="modelopt",
             tensors=["weight"]),
        rule("FP8_DEFAULT_CFG", "inputs", format="fp8_e4m3", granularity="tensor", fp8_variant="modelopt",
             tensors=["input"], scale_source="static", observer="static_minmax"),
    ])

MXFP8_DEFAULT_CFG = config_preset(
    "MXFP8_DEFAULT_CFG", "MXFP8 E4M3 weights and inputs, E8M0 scale 2^ceil(log2(amax/448)) per 32, "
    "no calibration", [
        rule("MXFP8_DEFAULT_CFG", "weights and inputs", format="mxfp8_e4m3", tensors=["weight", "input"],
             block_size=32, scale_rule="rceil"),
    ])

INT4_BLOCKWISE_WEIGHT_ONLY_CFG = config_preset(
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "int4 weights, one scale amax/7 per 128 input features, "
    "16-bit activations", [
        rule("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "weights", format="int4", int_range="modelopt", tensors=["weight"]),
    ])


def kv_config(config: str, what: str, fields: dict[str, Any]) -> Preset:
    """A KV-cache config alone (to be listed after a weight config): ModelOpt's `k_bmm` / `v_bmm`
    quantizers on the keys and values after RoPE, every cached token, max-calibrated (the amax
    over all batches); the query and softmax quantizers stay off."""
    return register_preset(Preset(
        name=f"{STACK}/{config}",
        reproduces=f"ModelOpt's {config} ({what}) on every attention",
        checked_against=VERSION + " (from source)",
        content={"quantize": [{"name": f"{STACK}/{config} key/value", "targets": ["Attention"],
                               "tensors": ["key", "value"], **fields,
                               "scale_source": "static", "observer": "static_minmax"}]},
    ))


kv_config("FP8_KV_CFG", "FP8 E4M3 keys and values, one static scale each",
          {"format": "fp8_e4m3", "fp8_variant": "modelopt", "granularity": "tensor"})
kv_config("NVFP4_KV_CFG", "NVFP4 keys and values: 16-element blocks along head_dim, a static "
          "global scale", {"format": "nvfp4", "nvfp4_variant": "modelopt"})
