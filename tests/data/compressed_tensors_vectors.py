"""Golden vectors from compressed-tensors' own functions, for the stack-convention formats.

    /tmp/llmc-venv/bin/python tests/data/compressed_tensors_vectors.py tests/data/compressed-tensors-vectors.npz

Runs in an environment with compressed-tensors 0.19 (llm-compressor 0.14's), which the main
environment does not install, and records, for each scheme llm-compressor builds from it, the
input and the fake-quantized output bit patterns computed by compressed-tensors itself:
`calculate_qparams` (weights: min/max reduced per channel, group or 2D block, as its observers
reduce them) or `compute_dynamic_scales_and_zp` (dynamic activations), then its `fake_quantize`.
`tests/formats/test_formats_stacks.py` checks qtransform's `fake_quantize` against them with
the options each case names (`CASES` below: format and keywords; `meta` in the file). The
arrays hold bit patterns (int32 for fp32, int16 for bf16): `<input kind>/<dtype>` the inputs,
`<case>/<dtype>` compressed-tensors' outputs. fp32 and bf16 inputs: with a
bf16 model compressed-tensors keeps its scales, and computes x / scale, in bf16.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import (
    calculate_qparams,
    compute_dynamic_scales_and_zp,
    maybe_pad_tensor_for_block_quant,
)

FP8 = dict(num_bits=8, type="float", symmetric=True)
MX = dict(type="float", symmetric=True, group_size=32, scale_dtype=torch.uint8, zp_dtype=torch.uint8)


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian rows over 12 decades of scale, a zero row, a row whose scale underflows, rows
    of ties, maxima and MX-rule boundaries."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows)[:, None]
    w[1] = 0.0
    w[2] = torch.randn(cols, generator=g) * 1e-41  # fp32 subnormals: amax / 448 underflows
    w[3, :7] = torch.tensor([448.0, -448.0, 0.5, -0.0, 7.5, -7.5, 127.5])  # ties and maxima
    # block maxima of exactly 1.75 * 2^k (7.0, 448): where MX rules that agree elsewhere part
    w[4] = torch.linspace(-7.0, 7.0, cols)
    w[4, 1::3] *= 1e-4  # small elements: the scale's power of two shows in E4M3's subnormals
    w[4, 1], w[5, 1] = 3 * 2.0**-15, 3 * 2.0**-9  # 1.5 subnormal steps under one rule, 3 under another
    w[5] = torch.linspace(448.0, -448.0, cols) / 3
    w[5, ::32] = 448.0
    return w


def _activation(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 256, generator=g) * torch.logspace(-3, 3, 5)[None, :, None]


def _minmax_qdq(x: torch.Tensor, args: QuantizationArgs, reduce) -> torch.Tensor:
    """Weights: min/max per scale (as the observers reduce them), calculate_qparams, QDQ."""
    lo, hi = reduce(x, torch.amin), reduce(x, torch.amax)
    scale, zp = calculate_qparams(lo, hi, args)
    return fake_quantize(x, scale, zp, args)


def _per_channel(x, f):
    return f(x, dim=1, keepdim=True)


def _per_group(size):
    def reduce(x, f):
        return f(x.unflatten(-1, (x.shape[-1] // size, size)), dim=-1)
    return reduce


def _per_block(h, w):
    def reduce(x, f):
        xp = maybe_pad_tensor_for_block_quant(x, [h, w])
        r, c = xp.shape[0] // h, xp.shape[1] // w
        return f(xp.reshape(r, h, c, w).transpose(1, 2).reshape(r, c, h * w), dim=-1)
    return reduce


def _whole(x, f):
    return f(x).reshape(1)


def _dynamic(x: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=None)
    return fake_quantize(x, scale, zp, args)


# name -> (input kind, compressed-tensors' computation, qtransform format, keywords)
CASES = {
    "fp8_tensor_weight": ("w", lambda x: _minmax_qdq(x, QuantizationArgs(**FP8, strategy="tensor"), _whole),
                          "fp8_e4m3", {"granularity": "tensor"}),
    "fp8_channel_weight": ("w", lambda x: _minmax_qdq(x, QuantizationArgs(**FP8, strategy="channel"), _per_channel),
                           "fp8_e4m3", {"granularity": "channel"}),
    "fp8_block_128x128": ("w_big", lambda x: _minmax_qdq(
        x, QuantizationArgs(**FP8, strategy="block", block_structure=[128, 128]), _per_block(128, 128)),
        "fp8_e4m3", {"block_shape": [128, 128]}),
    "fp8_block_16x32": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(**FP8, strategy="block", block_structure=[16, 32]), _per_block(16, 32)),
        "fp8_e4m3", {"block_shape": [16, 32]}),
    "fp8_group_128_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(**FP8, strategy="group", group_size=128), _per_group(128)),
        "fp8_e4m3", {"block_size": 128}),
    "fp8_token_dynamic": ("a", lambda x: _dynamic(x, QuantizationArgs(**FP8, strategy="token", dynamic=True)),
                          "fp8_e4m3", {"granularity": "token"}),
    "fp8_tensor_dynamic": ("a", lambda x: _dynamic(x, QuantizationArgs(**FP8, strategy="tensor", dynamic=True)),
                           "fp8_e4m3", {"granularity": "tensor"}),
    "fp8_group_128_dynamic": ("a", lambda x: _dynamic(
        x, QuantizationArgs(**FP8, strategy="group", group_size=128, dynamic=True)),
        "fp8_e4m3", {"block_size": 128}),
    "int8_channel_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"), _per_channel),
        "int8", {"granularity": "channel", "int_range": "full"}),
    "int8_token_dynamic": ("a", lambda x: _dynamic(
        x, QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)),
        "int8", {"granularity": "token", "int_range": "full"}),
    "int4_group_128_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
        _per_group(128)), "int4", {"block_size": 128, "int_range": "full"}),
    "int4_group_32_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
        _per_group(32)), "int4", {"block_size": 32, "int_range": "full"}),
    "mxfp4_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(num_bits=4, strategy="group", **MX), _per_group(32)),
        "mxfp4", {"scale_rule": "even"}),
    "mxfp4_dynamic": ("a", lambda x: _dynamic(
        x, QuantizationArgs(num_bits=4, strategy="group", dynamic=True, **MX)),
        "mxfp4", {"scale_rule": "even"}),
    "mxfp8_weight": ("w", lambda x: _minmax_qdq(
        x, QuantizationArgs(num_bits=8, strategy="group", **MX), _per_group(32)),
        "mxfp8_e4m3", {"scale_rule": "compressed-tensors"}),
}

INPUTS = {"w": lambda: _weight(24, 256, 1), "w_big": lambda: _weight(130, 136, 2), "a": lambda: _activation(3)}
DTYPES = {"float32": (torch.float32, torch.int32), "bfloat16": (torch.bfloat16, torch.int16)}


def main(path: str) -> None:
    arrays, meta = {}, {}
    for dname, (dtype, bits) in DTYPES.items():
        for kind, make in INPUTS.items():
            arrays[f"{kind}/{dname}"] = make().to(dtype).view(bits).numpy()
    for name, (kind, ct, fmt, kwargs) in CASES.items():
        for dname, (dtype, bits) in DTYPES.items():
            x = torch.from_numpy(arrays[f"{kind}/{dname}"]).view(dtype)
            y = ct(x.clone())
            assert y.dtype == dtype and y.shape == x.shape, (name, y.dtype, y.shape)
            arrays[f"{name}/{dname}"] = y.view(bits).numpy()
            options = kwargs if fmt.startswith("mx") else {**kwargs, "scale_dtype": "input"}
            meta[f"{name}/{dname}"] = {"input": f"{kind}/{dname}", "format": fmt, "options": options}
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
