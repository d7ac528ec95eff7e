"""Reference numbers from NVIDIA ModelOpt for the `modelopt/...` presets (tests/schemas/test_modelopt_presets.py).

ModelOpt is not a dependency of qtransform (it needs CUDA for half of its kernels), so its
numbers are computed once, in an environment of their own, and committed:

    python3 -m venv /tmp/modelopt-venv
    /tmp/modelopt-venv/bin/pip install torch==2.13.0 nvidia-modelopt==0.47.0 transformers==5.24.0 requests
    cd /tmp && /tmp/modelopt-venv/bin/python /path/to/tests/data/make_modelopt_golden.py /path/to/tests/data/modelopt-golden.safetensors

(run it from outside the repository: ModelOpt's package is named `modelopt` and imports `torch`,
which a checkout's folders must not shadow). The model is qtransform's `build_tiny("qwen2")`
written out (transformers 5.23 and 5.24 initialise it identically from the seed; the file keeps
the parameter sum so a test can check). On CPU:

- `mtq.quantize(model, cfg, forward_loop)` runs for all four configs: calibration (max) runs
  with every quantizer off, so it needs no kernel. The per-Linear input and weight amax it
  calibrated are stored (`<cfg>.amax.<linear>.<input|weight>`).
- The fake-quantized forward runs for FP8_DEFAULT_CFG and INT4_BLOCKWISE_WEIGHT_ONLY_CFG (pure
  torch on CPU): their logits are stored. NVFP4_DEFAULT_CFG and MXFP8_DEFAULT_CFG need CUDA
  there (a Triton kernel, a CUDA extension): the error each raises is stored in the metadata, and
  what the deployed checkpoint holds is stored instead, computed by ModelOpt's own export code
  (`NVFP4QTensor`, `MXFP8QTensor`, pure torch): the dequantized weights of layer 0, NVFP4 both
  with its own global scale and with the global scale the export fuses across q/k/v and gate/up
  (`preprocess_linear_fusion`: the largest amax of the group), and an MXFP8 round trip of a
  random activation.
"""

from __future__ import annotations

import copy
import json
import sys

import modelopt
import modelopt.torch.quantization as mtq
import torch
import transformers as tf
from modelopt.torch.quantization import config as mtq_config
from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
from safetensors.torch import save_file

CONFIGS = ("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", "MXFP8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def tiny_qwen2() -> torch.nn.Module:
    """qtransform.models.build_tiny("qwen2") (2 layers, hidden 64), seeded the same way."""
    config = tf.Qwen2Config(vocab_size=256, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()


def main(out: str) -> None:
    model = tiny_qwen2()
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    tensors: dict[str, torch.Tensor] = {"calib": calib, "ids": ids}
    meta = {"modelopt": modelopt.__version__, "transformers": tf.__version__, "torch": torch.__version__,
            "param_sum": repr(sum(float(p.double().sum()) for p in model.parameters()))}

    def loop(m: torch.nn.Module) -> None:
        for batch in calib.split(2):  # two calibration batches: the max runs over both
            m(input_ids=batch)

    with torch.no_grad():
        tensors["fp.logits"] = model(input_ids=ids).logits
        for name in CONFIGS:
            quant = copy.deepcopy(model)
            mtq.quantize(quant, getattr(mtq_config, name), loop)
            for mod_name, module in quant.named_modules():
                for point in ("input", "weight"):
                    q = getattr(module, f"{point}_quantizer", None)
                    amax = getattr(q, "_amax", None) if q is not None and q.is_enabled else None
                    if amax is not None:
                        tensors[f"{name}.amax.{mod_name}.{point}"] = amax.detach().float().clone()
            try:
                tensors[f"{name}.logits"] = quant(input_ids=ids).logits
                meta[f"{name}.cpu"] = "runs"
            except Exception as exc:  # noqa: BLE001 - recorded, the reason is the result
                meta[f"{name}.cpu"] = f"{type(exc).__name__}: {exc}"

        layer = model.model.layers[0]
        linears = {f"model.layers.0.{part}.{leaf}": getattr(getattr(layer, part), leaf)
                   for part, leaves in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                        ("mlp", ("gate_proj", "up_proj", "down_proj"))) for leaf in leaves}
        fused_amax = {}
        for group in FUSED:
            members = [n for n in linears if n.rsplit(".", 1)[-1] in group]
            top = torch.stack([linears[n].weight.abs().amax() for n in members]).amax()
            fused_amax.update(dict.fromkeys(members, top))
        for name, linear in linears.items():
            w = linear.weight.detach()
            for tag, amax in (("own", w.abs().amax()), ("fused", fused_amax.get(name, w.abs().amax()))):
                wsf2 = amax.float() / (6.0 * 448.0)  # NVFP4QTensor.get_weights_scaling_factor_2
                packed, scale, double = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=wsf2)
                tensors[f"nvfp4.{tag}.{name}"] = packed.dequantize(
                    torch.float32, scale=scale, double_scale=double, block_sizes={-1: 16})
            packed, scale = MXFP8QTensor.quantize(w.clone())
            tensors[f"mxfp8.{name}"] = packed.dequantize(torch.float32, scale=scale)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 64)
        packed, scale = MXFP8QTensor.quantize(x.clone())
        tensors["mxfp8.x"], tensors["mxfp8.x_q"] = x, packed.dequantize(torch.float32, scale=scale)
    meta["configs"] = json.dumps({n: getattr(mtq_config, n) for n in CONFIGS}, default=str)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata=meta)


if __name__ == "__main__":
    main(sys.argv[1])
