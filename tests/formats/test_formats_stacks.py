"""The deployment stacks' conventions, checked against their own numbers.

`tests/data/compressed-tensors-vectors.npz` holds inputs and compressed-tensors 0.19's outputs
for every scheme llm-compressor builds from it (FP8 per tensor / channel / token / group / 2D
block, int8 per channel and token, int4 groups, MXFP4, MXFP8), fp32 and bf16, written by
`tests/data/compressed_tensors_vectors.py` in an environment where compressed-tensors runs.
qtransform must give the same bits with the options each case names, except the sign of an
exact zero: compressed-tensors adds its zero point (+0.0) to x / scale, so -0 comes out +0,
while qtransform keeps -0 (docs/numerics.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from qtransform.formats import fake_quantize

DATA = np.load(Path(__file__).parents[1] / "data" / "compressed-tensors-vectors.npz")
META = json.loads(bytes(DATA["meta"]).decode())
DTYPES = {np.dtype(np.int32): torch.float32, np.dtype(np.int16): torch.bfloat16}


def _tensor(key: str) -> torch.Tensor:
    raw = torch.from_numpy(DATA[key])
    return raw.view(DTYPES[DATA[key].dtype])


@pytest.mark.parametrize("case", sorted(META))
def test_equals_compressed_tensors_bit_for_bit(case):
    meta = META[case]
    x, want = _tensor(meta["input"]), _tensor(case)
    got = fake_quantize(x, meta["format"], **meta["options"])
    assert got.dtype == want.dtype
    ints = torch.int32 if got.dtype == torch.float32 else torch.int16
    differ = got.view(ints) != want.view(ints)
    # the only difference allowed: our -0.0 where compressed-tensors wrote +0.0
    signed_zero = (got == 0) & (want == 0) & torch.signbit(got) & ~torch.signbit(want)
    assert not (differ & ~signed_zero).any(), (
        f"{int((differ & ~signed_zero).sum())} of {got.numel()} differ, e.g. x="
        f"{x[differ & ~signed_zero][:3].tolist()}: got {got[differ & ~signed_zero][:3].tolist()}, "
        f"compressed-tensors {want[differ & ~signed_zero][:3].tolist()}")


def test_the_vectors_cover_every_scheme_and_both_dtypes():
    """The file is what the tests claim: each granularity, both integer widths, fp32 and bf16."""
    cases = {key.split("/")[0] for key in META}
    assert {"fp8_tensor_weight", "fp8_channel_weight", "fp8_token_dynamic", "fp8_block_128x128",
            "fp8_group_128_dynamic", "int8_channel_weight", "int8_token_dynamic",
            "int4_group_128_weight", "mxfp4_weight", "mxfp8_weight"} <= cases
    assert all(f"{c}/float32" in META and f"{c}/bfloat16" in META for c in cases)


def test_mxfp4_even_is_compressed_tensors_and_mxfp8_needs_its_own_rule():
    """compressed-tensors rounds an MX block's amax at E2M1's one mantissa bit for MXFP8 too:
    `scale_rule: even` (the element's own width) equals it for MXFP4 only, and
    `scale_rule: compressed-tensors` for both. (Older vectors had its MXFP8 equal to rceil: the
    two part only where a block amax is exactly 1.75 * 2^k and an element sits in E4M3's
    subnormals, which the vectors' rows 4 and 5 hold.)"""
    for case, rules in (("mxfp4_weight/float32", ("even", "compressed-tensors")),
                        ("mxfp8_weight/float32", ("compressed-tensors",))):
        x, want = _tensor(META[case]["input"]), _tensor(case)
        for rule in rules:
            assert torch.equal(fake_quantize(x, META[case]["format"], scale_rule=rule), want)
    x, want = _tensor(META["mxfp8_weight/float32"]["input"]), _tensor("mxfp8_weight/float32")
    # neither the element's own width nor rceil (equal but where amax is 1.75 * 2^k exactly)
    for rule in ("even", "rceil"):
        assert not torch.equal(fake_quantize(x, "mxfp8_e4m3", scale_rule=rule), want)


def test_bf16_scales_are_what_compressed_tensors_computes_for_a_bf16_model():
    """With a bf16 input, compressed-tensors' scale and x / scale are bf16: scale_dtype 'input'
    reproduces that, fp32 scales (the default) do not."""
    case = "fp8_channel_weight/bfloat16"
    x, want = _tensor(META[case]["input"]), _tensor(case)
    same = fake_quantize(x, "fp8_e4m3", granularity="channel", scale_dtype="input")
    assert torch.equal(same, want)
    assert torch.equal(fake_quantize(x, "fp8_e4m3", granularity="channel", scale_dtype="bfloat16"), want)
    assert not torch.equal(fake_quantize(x, "fp8_e4m3", granularity="channel"), want)


MODELOPT = np.load(Path(__file__).parents[1] / "data" / "modelopt-vectors.npz")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("case", "fmt", "options", "others"), [
    # INT4_BLOCKWISE_WEIGHT_ONLY_CFG
    ("int4_block_128", "int4", {"block_size": 128, "int_range": "modelopt"},
     [{"int_range": "restricted"}, {"int_range": "full"}]),
    ("int8_channel", "int8", {"granularity": "channel", "int_range": "modelopt"},
     [{"int_range": "restricted"}, {"int_range": "full"}]),
    ("fp8_tensor", "fp8_e4m3", {"granularity": "tensor", "fp8_variant": "modelopt"}, []),  # FP8_DEFAULT_CFG
    ("fp8_channel", "fp8_e4m3", {"granularity": "channel", "fp8_variant": "modelopt"},
     [{"fp8_variant": "default"}]),
])
def test_modelopt_bit_for_bit(case, fmt, options, others, dtype):
    """ModelOpt 0.47's CPU quantizers (tests/data/modelopt_vectors.py), signed zeros included.
    Integers: a multiplier qmax / amax, round, clamp to [qmin, qmax], divide; blocks with amax
    <= 2^-24 give zeros (`int_range: "modelopt"`). FP8: a multiplier fl(1 / amax) * 448, the
    product clamped and cast, times fl(1 / multiplier) (`fp8_variant: "modelopt"`). The other
    conventions differ in the last bits (the per-tensor case happens not to show it)."""
    ints = torch.int32 if dtype == "float32" else torch.int16
    x = torch.from_numpy(MODELOPT[f"w/{dtype}"]).view(getattr(torch, dtype))
    want = torch.from_numpy(MODELOPT[f"{case}/{dtype}"])
    assert torch.equal(fake_quantize(x, fmt, **options).view(ints), want)
    for other in others:
        assert not torch.equal(fake_quantize(x, fmt, **{**options, **other}).view(ints), want)
