"""The Triton Walsh-Hadamard kernel (formats/triton_kernels.py `fwht`), run on CPU by Triton's
interpreter, against the torch butterfly bit for bit (the same fp32 operations in the same order)
and so against the dense reference up to the rounding bound of test_hadamard_fast.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qtransform.formats import hadamard as H

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the GPU "
                                     "kernels cannot be checked")
# as in test_triton_kernels.py: the interpreter needs TRITON_INTERPRET=1 from the process start
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
if CHILD:
    from qtransform.formats import triton_kernels
child_only = pytest.mark.skipif(not CHILD, reason="runs in the interpreter process")


@pytest.mark.skipif(CHILD, reason="this is the interpreter process")
def test_fwht_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p",
                          "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "16 passed" in run.stdout, run.stdout[-500:]


@child_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [1, 2, 8, 32, 256])
def test_fwht_kernel_is_the_butterfly_bit_for_bit(dtype, b):
    """With and without signs, 3-D input, a ragged last program (blocks not a multiple of the
    kernel's group), NaN confined to its block."""
    g = torch.Generator().manual_seed(b)
    x = (torch.randn(3, 7, 2 * b, generator=g) * 20).to(dtype)
    x[0, 0, 0] = float("nan")
    for signs in (None, H.random_signs(b, 6)):
        fast = triton_kernels.fwht(x, b, signs, H.scale_of(b))
        slow = H.butterfly(x, b, signs)
        assert fast.dtype == dtype and fast.shape == x.shape
        assert torch.equal(torch.isnan(fast), torch.isnan(slow))
        keep = ~torch.isnan(slow)
        assert torch.equal(fast[keep], slow[keep])


@child_only
def test_fwht_kernel_whole_axis_of_4096():
    x = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    signs = H.random_signs(4096, 1)
    assert torch.equal(triton_kernels.fwht(x, 4096, signs, H.scale_of(4096)),
                       H.butterfly(x, 4096, signs))
