"""The Triton GPU kernels (formats/triton_kernels.py), run on CPU by Triton's interpreter, against
the reference path bit for bit. On a GPU the same kernels run compiled (tests/distributed/test_cuda.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qtransform.formats import fake_quantize, saturated
from qtransform.formats.options import resolve
from qtransform.formats.quantize import layout_for

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the GPU "
                                     "kernels cannot be checked")
# Triton reads TRITON_INTERPRET when it decorates and launches kernels, and a session that has
# used torch.compile leaves it in a state where the interpreter fails: the kernel tests run in a
# fresh process with the variable set from its start (the test below), nowhere else.
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
if CHILD:
    from qtransform.formats import triton_kernels
child_only = pytest.mark.skipif(not CHILD, reason="runs in the interpreter process")


@pytest.mark.skipif(CHILD, reason="this is the interpreter process")
def test_kernels_under_the_interpreter():
    """Every test of this file, in a fresh process under TRITON_INTERPRET=1."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p",
                          "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "47 passed" in run.stdout, run.stdout[-500:]


CASES = [
    ("mxfp4", {}), ("mxfp4", {"scale_rule": "rceil"}), ("mxfp4", {"scale_rule": "ceil"}),
    ("mxfp4", {"scale_rule": "even", "rounding": "rna"}), ("mxfp6_e2m3", {}),
    ("mxfp6_e3m2", {"rounding": "rna"}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {"scale_rule": "even"}),
    ("mxint8", {}), ("nvfp4", {}), ("nvfp4", {"rounding": "rna"}),
    ("nvfp4", {"nvfp4_variant": "one_level"}), ("nvfp4", {"four_over_six": "mse"}),
    ("nvfp4", {"four_over_six": "mae", "global_bound": 256}),
    ("nvfp4", {"four_over_six": "mae", "rounding": "rna"}),
]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def adversarial(rows: int, cols: int, seed: int) -> torch.Tensor:
    """N(0,1) at mixed scales, plus ties, powers of two and their neighbours, E4M3 edges,
    subnormals, huge values, signed zeros, NaN and Inf, each in its own blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 6, rows)[:, None]
    specials = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, -2.5, 7.9999995, 8.0, 448.0, 464.0,
                             480.0, 2.0 ** -127, 2.0 ** -149, -(2.0 ** -140), 3.0e38, -6.0])
    x[1, : specials.numel()] = specials
    x[2] = 0.0
    x[3, :5] = torch.tensor([float("nan"), 1.0, -2.0, 3.0, 4.0])
    x[4, 7] = float("inf")
    x[5] *= 1e-39  # a row of fp32 subnormals
    return x


def reference_bits(x: torch.Tensor, fmt: str, axis: int, opts: dict) -> tuple:
    out = fake_quantize(x, fmt, axis=axis, **opts)
    return out.view(BITS[x.dtype]), saturated(x, fmt, axis=axis, **opts)


@child_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fmt", "opts"), CASES)
def test_kernels_match_reference_bit_for_bit(fmt, opts, dtype):
    """Values (as bits: NaN payloads and signed zeros count) and saturation masks, along the last
    axis with ragged rows (70 = 2 blocks + a partial one) and along axis 0."""
    for axis, shape in ((-1, (12, 70)), (0, (64, 6))):
        x = adversarial(*shape, seed=len(fmt) + shape[0]) if axis == -1 else \
            torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 40
        x = x.to(dtype)
        cfg = resolve(fmt, axis=axis, **opts)
        layout = layout_for(x, cfg)
        assert triton_kernels.supported(x, cfg, layout, exponents=False)
        out, sat = triton_kernels.run(x, cfg, layout, want_sat=True)
        want, want_sat = reference_bits(x, fmt, axis, opts)
        got = out.reshape(x.shape).view(BITS[dtype])
        assert torch.equal(got, want), f"{(got != want).sum()} elements differ along axis {axis}"
        assert torch.equal(sat.reshape(x.shape), want_sat)


@child_only
def test_kernels_blocks_of_other_sizes():
    """A block size that is not the default (and not a power of two: padded lanes masked)."""
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    for fmt, block in (("mxfp4", 64), ("mxfp8_e4m3", 48)):
        try:
            cfg = resolve(fmt, block_size=block)
        except ValueError:
            continue  # the registry refuses this size for this format
        out, _ = triton_kernels.run(x, cfg, layout_for(x, cfg), want_sat=False)
        want = fake_quantize(x, fmt, block_size=block)
        assert torch.equal(out.reshape(x.shape).view(torch.int32), want.view(torch.int32))


@child_only
def test_what_the_kernels_leave_to_the_reference_path():
    """Tiles, stochastic rounding, integer groups, the compressed-tensors order, MX exponents and
    float64 run on the reference path (which runs on CUDA unchanged)."""
    x = torch.randn(4, 64)
    for fmt, opts in (("mxfp4", {"block_shape": (32, 32)}), ("mxfp4", {"rounding": "stochastic"}),
                      ("int4", {}), ("nvfp4", {"nvfp4_variant": "compressed-tensors"})):
        cfg = resolve(fmt, **opts)
        assert not triton_kernels.supported(x, cfg, layout_for(x, cfg), exponents=False)
    cfg = resolve("mxfp4")
    assert not triton_kernels.supported(x, cfg, layout_for(x, cfg), exponents=True)
    assert not triton_kernels.supported(x.double(), cfg, layout_for(x, cfg), exponents=False)
    # a CPU tensor never takes the GPU path, whatever it is
    assert triton_kernels.quantize(x, cfg, layout_for(x, cfg), want_sat=False) is None
