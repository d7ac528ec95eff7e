"""Golden vectors from NVIDIA ModelOpt's own integer fake quantizer.

    /tmp/modelopt-venv/bin/python tests/data/modelopt_vectors.py tests/data/modelopt-vectors.npz

Runs where nvidia-modelopt 0.47 is installed (the main environment does not install it) and
records ModelOpt's CPU quantizers, `modelopt.torch.quantization.tensor_quant._tensor_quant`
(integers: what `FakeTensorQuantFunction` runs for CPU tensors) and `scaled_e4m3_impl` (FP8 E4M3,
its eager CPU path), with the amax its max calibration gives: int4 blocks of 128 along the last
dim (INT4_BLOCKWISE_WEIGHT_ONLY_CFG: num_bits 4, block_sizes {-1: 128}, narrow_range False), int8
per output channel, FP8 per tensor (FP8_DEFAULT_CFG) and per channel, fp32 and bf16. `tests/formats/test_formats_stacks.py` checks qtransform's `int_range: "modelopt"` against
them. Arrays hold bit patterns (int32 for fp32, int16 for bf16): `w/<dtype>` the input,
`<case>/<dtype>` ModelOpt's output.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from modelopt.torch.quantization.tensor_quant import _tensor_quant, scaled_e4m3_impl


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows)[:, None]
    w[1] = 0.0
    w[2] = torch.randn(cols, generator=g) * 1e-8  # amax below ModelOpt's 2^-24: zeros
    w[3, :6] = torch.tensor([7.0, -7.0, 3.5, -0.0, 0.5, -2.5])  # ties at scale 1
    return w


def _int4_blocks(w: torch.Tensor) -> torch.Tensor:
    blocks = w.reshape(-1, 128)
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # max calibration, per block
    return _tensor_quant(blocks, amax, num_bits=4, unsigned=False, narrow_range=False).reshape(w.shape)


def _int8_channel(w: torch.Tensor) -> torch.Tensor:
    amax = w.abs().amax(dim=-1, keepdim=True)
    return _tensor_quant(w, amax, num_bits=8, unsigned=False, narrow_range=False)


def _fp8_tensor(w: torch.Tensor) -> torch.Tensor:
    """FP8_DEFAULT_CFG (num_bits e4m3, axis None): one amax for the tensor."""
    return scaled_e4m3_impl(w, w.abs().amax().float())


def _fp8_channel(w: torch.Tensor) -> torch.Tensor:
    """FP8 per channel (axis 0: one amax per output row)."""
    return scaled_e4m3_impl(w, w.abs().amax(dim=-1, keepdim=True).float())


CASES = {"int4_block_128": _int4_blocks, "int8_channel": _int8_channel,
         "fp8_tensor": _fp8_tensor, "fp8_channel": _fp8_channel}
DTYPES = {"float32": (torch.float32, torch.int32), "bfloat16": (torch.bfloat16, torch.int16)}


def main(path: str) -> None:
    arrays = {}
    for dname, (dtype, bits) in DTYPES.items():
        w = _weight(24, 256, 7).to(dtype)
        arrays[f"w/{dname}"] = w.view(bits).numpy()
        for name, fn in CASES.items():
            y = fn(w.clone())
            assert y.dtype == dtype and y.shape == w.shape
            arrays[f"{name}/{dname}"] = y.view(bits).numpy()
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
