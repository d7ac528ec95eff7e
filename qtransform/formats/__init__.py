"""Number formats: the registry and the numerics (fake quantization, encode/decode).

See docs/numerics.md for the contract every function here implements bit for bit.
"""

from qtransform.formats.encode import Encoded, decode, encode
from qtransform.formats.quantize import block_exponents, fake_quantize, saturated
from qtransform.formats.registry import ElementSpec, FormatSpec, get, names, suggest

__all__ = [
    "ElementSpec",
    "Encoded",
    "FormatSpec",
    "block_exponents",
    "decode",
    "encode",
    "fake_quantize",
    "get",
    "names",
    "saturated",
    "suggest",
]
