"""Validation of a fake-quantization request into one immutable `QuantConfig`.

Every public entry point (fake_quantize, saturated, encode, block_exponents) takes the same
keywords; checking them in one place gives the same clear errors everywhere, and the frozen result
is hashable, so it can be cached and handed to the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qtransform.formats import registry
from qtransform.formats.registry import FormatSpec

CHOICE_OPTIONS = ("scale_rule", "rounding", "nvfp4_variant")  # strings a format lists values of
NUMERICS_OPTIONS = ("block_size", "block_shape", *CHOICE_OPTIONS)  # what changes the numbers
COMMON_OPTIONS = ("zero_saturated_grad",)  # format options every format accepts (bool)
ALL_FORMAT_OPTIONS = ("nvfp4_variant", *COMMON_OPTIONS)
KEYWORDS = ("block_size", "axis", "block_shape", "scale_rule", "rounding", "generator", "seed")


@dataclass(frozen=True)
class QuantConfig:
    """A validated request: the format and every numerics option, defaults filled in."""

    spec: FormatSpec
    block: int  # 1D block length (0 when `tile` is set)
    tile: tuple[int, int] | None
    axis: int
    scale_rule: str
    rounding: str
    nvfp4_variant: str
    zero_saturated_grad: bool

    @property
    def family(self) -> str:
        return self.spec.family


def _choice(spec: FormatSpec, option: str, value: Any) -> str:
    allowed = spec.options[option]
    if value not in allowed:
        raise ValueError(
            f"{spec.name}: {option}={value!r} is not allowed{registry.suggest(str(value), allowed)};"
            f" allowed: {', '.join(allowed)}"
        )
    return value


def _block_size(spec: FormatSpec, block_size: Any) -> int:
    if block_size is None:
        return spec.default_block
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"{spec.name}: block_size must be an int, got {block_size!r}")
    spec.check_block(block_size)
    return block_size


def _tile(spec: FormatSpec, block_shape: Any, block_size: Any, axis: int) -> tuple[int, int]:
    if (
        not isinstance(block_shape, tuple | list)
        or len(block_shape) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in block_shape)
    ):
        raise ValueError(
            f"{spec.name}: block_shape must be a 2-tuple of ints such as {spec.tile}, "
            f"got {block_shape!r}"
        )
    if block_size is not None:
        raise ValueError(f"{spec.name}: pass either block_size or block_shape, not both")
    if axis != -1:
        raise ValueError(f"{spec.name}: block_shape tiles the last two dims; leave axis at -1")
    for v in block_shape:
        spec.check_block(v)
    return (block_shape[0], block_shape[1])


def resolve(
    fmt: str | FormatSpec,
    *,
    block_size: int | None = None,
    axis: int = -1,
    block_shape: tuple[int, int] | None = None,
    scale_rule: str = "floor",
    rounding: str = "rne",
    **format_options: Any,
) -> QuantConfig:
    """Check a request against the registry; raise ValueError naming what is allowed."""
    spec = fmt if isinstance(fmt, FormatSpec) else registry.get(fmt)
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ValueError(f"{spec.name}: axis must be an int, got {axis!r}")
    if block_shape is None:
        block, tile = _block_size(spec, block_size), None
    else:
        block, tile = 0, _tile(spec, block_shape, block_size, axis)
    if "scale_rule" in spec.options:
        scale_rule = _choice(spec, "scale_rule", scale_rule)
    elif scale_rule != "floor":
        raise ValueError(
            f"{spec.name}: scale_rule={scale_rule!r} applies to MX formats only "
            f"({', '.join(n for n in registry.names() if registry.get(n).family == 'mx')}); "
            f"{spec.name} has no scale_rule option"
        )
    rounding = _choice(spec, "rounding", rounding)
    opts = dict(format_options)
    allowed = tuple(o for o in ALL_FORMAT_OPTIONS if o in spec.options or o in COMMON_OPTIONS)
    for key in opts:
        if key not in allowed:
            raise ValueError(
                f"{spec.name}: unknown option {key!r}{registry.suggest(key, allowed + KEYWORDS)}; "
                f"allowed format options: {', '.join(allowed)}"
            )
    variant = "default"
    if "nvfp4_variant" in opts:
        variant = _choice(spec, "nvfp4_variant", opts["nvfp4_variant"])
    zsg = opts.get("zero_saturated_grad", False)
    if not isinstance(zsg, bool):
        raise ValueError(f"{spec.name}: zero_saturated_grad must be True or False, got {zsg!r}")
    return QuantConfig(spec, block, tile, axis, scale_rule, rounding, variant, zsg)
