"""Number formats: the registry and the numerics (fake quantization, encode/decode).

See docs/numerics.md for the contract every function here implements bit for bit.
"""

# isort: off
# each family module registers its family and formats (in this order: `names()` lists them so)
from qtransform.formats import mx, nvfp4, intgroup, fp8  # noqa: F401
# isort: on
from qtransform.formats.encode import Encoded, decode, encode
from qtransform.formats.options import QuantConfig
from qtransform.formats.quantize import block_exponents, fake_quantize, saturated
from qtransform.formats.registry import (
    ElementSpec,
    Family,
    FormatSpec,
    families,
    get,
    names,
    suggest,
)

__all__ = [
    "ElementSpec",
    "Encoded",
    "Family",
    "FormatSpec",
    "QuantConfig",
    "block_exponents",
    "decode",
    "encode",
    "fake_quantize",
    "families",
    "get",
    "names",
    "saturated",
    "suggest",
]
