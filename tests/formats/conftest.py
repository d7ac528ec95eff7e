"""The compiled CPU library, for the tests of the fast path and of the Gaussian stream."""

from __future__ import annotations

import shutil

import pytest

from qtransform.formats import fastpath

HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None


@pytest.fixture(scope="module")
def lib():
    """The built library; a skip only where no compiler exists (then it cannot build)."""
    if not HAS_CC:
        pytest.skip("fast path not testable here: no C compiler (cc/gcc) on PATH")
    lib = fastpath.library()
    assert lib is not None, f"a compiler is installed, so the fast path must build: {fastpath.unavailable_reason()}"
    return lib
