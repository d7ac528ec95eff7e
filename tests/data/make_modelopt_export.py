"""ModelOpt's own Hugging Face checkpoints of the tiny Qwen2, NVFP4 and FP8: the reference of
tests/export/test_checkpoint_modelopt.py (qtransform's `format="modelopt"` writer).

Run in the ModelOpt environment of make_modelopt_golden.py, from outside the repository:

    cd /tmp && /tmp/modelopt-venv/bin/python /path/to/tests/data/make_modelopt_export.py /path/to/tests/data/modelopt-export.safetensors

`mtq.quantize(model, NVFP4_DEFAULT_CFG | FP8_DEFAULT_CFG, forward_loop)` then
`export_hf_checkpoint` (both run on CPU: the export quantizes with pure-torch code), on
`build_tiny("qwen2")` calibrated on the same two batches as make_modelopt_golden.py. Kept: every
tensor of the quantized Linears (`<config>.<name>`), and hf_quant_config.json and config.json's
quantization_config of each export in the metadata.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import modelopt
import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_modelopt_golden import tiny_qwen2  # noqa: E402

CONFIGS = {"nvfp4": "NVFP4_DEFAULT_CFG", "fp8": "FP8_DEFAULT_CFG"}


def main(out: str) -> None:
    calib = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    tensors: dict[str, torch.Tensor] = {}
    meta = {"modelopt": modelopt.__version__}
    for tag, name in CONFIGS.items():
        model = tiny_qwen2()
        model.config.architectures = ["Qwen2ForCausalLM"]  # the export reads it

        def loop(m: torch.nn.Module) -> None:
            for batch in calib.split(2):
                m(input_ids=batch)

        with torch.no_grad():
            mtq.quantize(model, getattr(mtq, name), loop)
        with tempfile.TemporaryDirectory() as folder:
            export_hf_checkpoint(model, export_dir=folder)
            for key, value in load_file(f"{folder}/model.safetensors").items():
                if ".layers." in key and not key.endswith(("norm.weight", ".bias")):
                    tensors[f"{tag}.{key}"] = value.contiguous()
            meta[f"{tag}.hf_quant_config"] = Path(folder, "hf_quant_config.json").read_text()
            meta[f"{tag}.quantization_config"] = json.dumps(
                json.loads(Path(folder, "config.json").read_text())["quantization_config"])
    save_file(tensors, out, metadata=meta)


if __name__ == "__main__":
    main(sys.argv[1])
