"""Format fields shared by the quantize rules and the backward roles: the option defaults, the
JSON-schema enums of every option, and the format-name validators."""

from __future__ import annotations

from typing import Any

from qtransform.formats import registry

from .errors import Issue, problems_error

# Option defaults used for formats that do not list the option in FormatSpec.options.
OPTION_DEFAULTS = {"scale_rule": "floor", "rounding": "rne", "int_range": "restricted",
                   "scale_dtype": "float32"}
GLOBAL_BOUNDS = (448, 256)  # NVFP4 `global_bound`, as policies write it (the format's are strings)
FOUR_OVER_SIX_HELP = ("NVFP4 (default order, 1D blocks): mse or mae = quantize each block with "
                      "the scale mapping its amax to 6 and to 4, keep the one with the smaller "
                      "squared / absolute error (a tie keeps 6); null = max/6 only")
FOUR_OVER_SIX_ORDER_HELP = ("NVFP4 four over six: whose fp32 details decide near-ties; null = pairwise "
                            "(qtransform's halving sum), transformer-engine, flashinfer, fouroversix "
                            "(the stack's scales, dequantization and summation; docs/recipes.md)")
GLOBAL_BOUND_HELP = ("NVFP4 (default order): the E4M3 value the tensor amax maps to; 448 "
                     "(null) or 256 (Transformer Engine's four-over-six, room for the max/4 scale)")


def all_option_values(option: str) -> list[str]:
    """Every value any registered format allows for `option` (for the JSON schema enum)."""
    values = [OPTION_DEFAULTS[option]] if option in OPTION_DEFAULTS else []
    for name in registry.names():
        values += [v for v in registry.get(name).options.get(option, ()) if v not in values]
    return values



def lowered(cls: type, value: object) -> Any:  # noqa: ARG001 (a pydantic class validator)
    """Format names are case-insensitive: "MXFP4" is mxfp4."""
    return value.lower() if isinstance(value, str) else value


def known_format(cls: type, value: str) -> str:  # noqa: ARG001 (a pydantic class validator)
    """A registered format name, else one problem listing them with the nearest."""
    known = registry.names()
    if value not in known:
        raise problems_error([Issue((), "unknown format", value, known, registry.suggest(value, known))])
    return value
