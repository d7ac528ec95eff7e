"""`QuantConfig`: the one representation of "a format and its options".

The policy's quantize rules, the fake-quant pass, the scans, the custom ops (as JSON) and the
ONNX exporter (as node attributes) all hold this object: validated once here, with the
family's defaults filled in, frozen and hashable, so it can be cached, compared and handed to
the fast path. Every public entry point (fake_quantize, saturated, encode, block_exponents)
takes the same keywords and builds it with `resolve`, so the errors are the same everywhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from qtransform.formats import registry
from qtransform.formats.registry import Family, FormatSpec

# strings a family lists values of
CHOICE_OPTIONS = ("scale_rule", "rounding", "nvfp4_variant", "int_range", "scale_dtype", "fp8_variant",
                  "four_over_six", "global_bound", "four_over_six_order")
# what changes numbers
NUMERICS_OPTIONS = ("granularity", "block_size", "block_shape", "axis", *CHOICE_OPTIONS)
FORMAT_KEYS = (*NUMERICS_OPTIONS, "seed")  # the keys that belong to one format (not training's)
OPTION_KEYS = (*FORMAT_KEYS, "zero_saturated_grad")  # every key of `options()`
# what a config holds for a choice its family does not take (the kernels never read it)
NEUTRAL = {"scale_rule": "floor", "rounding": "rne", "nvfp4_variant": "default",
           "int_range": "restricted", "scale_dtype": "float32", "fp8_variant": "default",
           "four_over_six": "none", "global_bound": "448", "four_over_six_order": "pairwise"}
KEYWORDS = ("block_size", "axis", "block_shape", "granularity", "scale_rule", "rounding",
            "generator", "seed", "amax", "scale")
WHOLE_ROW = ("channel", "token", "tensor")  # granularities whose kernel blocks are whole rows
_PER = {"channel": "per channel", "token": "per token", "tensor": "per tensor"}


@dataclass(frozen=True)
class QuantConfig:
    """A validated format + options: the format, its blocking, every choice option of its
    family (defaults filled in), the training option and the stochastic-rounding seed.

    `axis` None means "the reduction axis of the tensor it is applied to" (a policy rule that
    leaves it unset; the pass and the scans `bind` it per site); kernels read None as -1.
    `seed` is the base seed of stochastic rounding's stream, None when the caller draws one.
    `granularity` says what one scale covers (`registry.GRANULARITIES`); "channel", "token" and
    "tensor" have `block` 0: their blocks are the whole rows along `axis` of the tensor at hand.
    """

    spec: FormatSpec
    block: int  # 1D block length (0 when `tile` is set or the granularity is a whole row)
    tile: tuple[int, int] | None
    axis: int | None
    scale_rule: str
    rounding: str
    nvfp4_variant: str
    zero_saturated_grad: bool = False
    seed: int | None = None
    int_range: str = "restricted"
    scale_dtype: str = "float32"
    granularity: str = "block"
    fp8_variant: str = "default"
    four_over_six: str = "none"  # NVFP4: "mse"/"mae" keep the better of the max/6 and max/4 scales
    global_bound: str = "448"  # NVFP4: the E4M3 value the tensor amax maps to
    four_over_six_order: str = "pairwise"  # NVFP4: whose fp32 details decide four over six

    @property
    def family(self) -> Family:
        return self.spec.family

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def block_axis(self) -> int:
        """The blocking axis the kernels use (unbound: the last dim)."""
        return -1 if self.axis is None else self.axis

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def bind(self, axis: int) -> QuantConfig:
        """This config with an unset axis replaced by `axis` (a site's reduction axis); a set
        axis and 2D tiles keep theirs."""
        return self if self.axis is not None or self.tile else replace(self, axis=axis)

    def numerics(self) -> dict[str, Any]:
        """The options that change the numbers, every one spelled out: the block (size or
        shape), the axis when bound, and each choice option of the family. This is what ONNX
        node attributes and reports record."""
        out: dict[str, Any]
        if self.tile:
            out = {"block_shape": list(self.tile)}
        elif self.granularity in WHOLE_ROW:
            out = {"granularity": self.granularity}
        else:
            out = {"block_size": self.block}
        if self.axis is not None:
            out["axis"] = self.axis
        fam = self.family
        out |= {option: getattr(self, option) for option in fam.options
                if option not in fam.quiet or getattr(self, option) != fam.default(option)}
        return out

    def options(self) -> dict[str, Any]:
        """`numerics()` plus `zero_saturated_grad` (when set) and `seed` (stochastic, when
        set): keyword options of `fake_quantize` (`block_shape` as a list, JSON-ready) and the
        input of `from_options`."""
        out = self.numerics()
        if self.zero_saturated_grad:
            out["zero_saturated_grad"] = True
        if self.seed is not None and self.stochastic:
            out["seed"] = self.seed
        return out

    def describe(self) -> str:
        """One line for plans: 'mxfp4 block=32, scale_rule=floor, rounding=rne' or
        'fp8_e4m3 per channel, rounding=rne, scale_dtype=float32'."""
        opts = self.options()
        opts.pop("axis", None)
        if opts.get("fp8_variant") == "default":  # the plain order, as plans wrote it before the option
            del opts["fp8_variant"]
        if self.tile:
            head = f"{self.name} block={'x'.join(map(str, opts.pop('block_shape')))}"
        elif self.granularity in WHOLE_ROW:
            head = f"{self.name} {_PER[opts.pop('granularity')]}"
        else:
            head = f"{self.name} block={opts.pop('block_size')}"
        return ", ".join([head, *(f"{k}={v}" for k, v in opts.items())])

    def to_json(self) -> str:
        """`options()` as canonical JSON: the `options` string of the `qtransform::fake_quant`
        custom op (custom-op schemas take only simple types)."""
        return json.dumps(self.options(), sort_keys=True)

    @classmethod
    def from_json(cls, fmt: str, text: str) -> QuantConfig:
        """The config `to_json` wrote (validated again)."""
        return cls.from_options(fmt, json.loads(text))

    @classmethod
    def from_options(cls, fmt: str | FormatSpec, options: Mapping[str, Any] | None = None) -> QuantConfig:
        """Validate a format and a dict of options (`OPTION_KEYS`; None values mean unset, a
        `block_shape` may be a list) into the canonical config. Axis unset stays unbound."""
        opts = {k: v for k, v in (options or {}).items() if v is not None}
        if isinstance(opts.get("block_shape"), list):
            opts["block_shape"] = tuple(opts["block_shape"])
        return resolve(fmt, **({"axis": None} | opts))


def _choice(spec: FormatSpec, option: str, value: object) -> str:
    allowed = spec.options[option]
    if value not in allowed:
        raise ValueError(
            f"{spec.name}: {option}={value!r} is not allowed{registry.suggest(str(value), allowed)};"
            f" allowed: {', '.join(allowed)}"
        )
    return value


def _block_size(spec: FormatSpec, block_size: object) -> int:
    if block_size is None:
        return spec.default_block
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"{spec.name}: block_size must be an int, got {block_size!r}")
    spec.check_block(block_size)
    return block_size


def _tile(spec: FormatSpec, block_shape: object, block_size: object, axis: int | None) -> tuple[int, int]:
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
    if axis not in (-1, None):
        raise ValueError(f"{spec.name}: block_shape tiles the last two dims; leave axis at -1")
    for v in block_shape:
        spec.check_block(v)
    return (block_shape[0], block_shape[1])


def _granularity(spec: FormatSpec, granularity: object, block_size: object, block_shape: object) -> str:
    """The granularity asked for (None: a tile with block_shape, else a block of block_size or
    of the format's default size), checked against the format's family and the block options given."""
    if granularity is not None and granularity not in registry.GRANULARITIES:
        raise ValueError(
            f"{spec.name}: granularity={granularity!r} is not allowed"
            f"{registry.suggest(str(granularity), registry.GRANULARITIES)}; "
            f"allowed: {', '.join(spec.family.granularities)}"
        )
    if granularity is None:
        if block_shape is not None:
            return "tile"
        return "block"
    if granularity not in spec.family.granularities:
        raise ValueError(
            f"{spec.name}: granularity {granularity!r} is not available (its scales are "
            f"{spec.scale}); allowed: {', '.join(spec.family.granularities)}"
        )
    if granularity in WHOLE_ROW and (block_size is not None or block_shape is not None):
        given = "block_size" if block_size is not None else "block_shape"
        raise ValueError(f"{spec.name}: granularity {granularity!r} has one scale per "
                         f"{'tensor' if granularity == 'tensor' else 'whole row'}; remove {given}")
    if granularity == "block" and block_shape is not None:
        raise ValueError(f"{spec.name}: block_shape gives 2D tiles; use granularity 'tile' "
                         "or a block_size")
    if granularity == "tile" and block_size is not None:
        raise ValueError(f"{spec.name}: granularity 'tile' takes block_shape, not block_size")
    return granularity


def _takers(option: str) -> str:
    """'MX formats only (mxfp4, ...)': the families and formats that take an option."""
    fams = [f for f in registry.families() if option in f.options]
    fmts = [n for n in registry.names() if registry.get(n).family in fams]
    return f"{'/'.join(f.name.upper() for f in fams)} formats only ({', '.join(fmts)})"


def _choices(spec: FormatSpec, given: dict[str, Any]) -> dict[str, str]:
    """Every choice option of the format's family, validated, defaults filled in; an option of
    another family is an error naming the families that take it (the MX scale rule's default
    is accepted anywhere: `fake_quantize`'s signature spells it)."""
    out = {}
    for option in CHOICE_OPTIONS:
        if option in spec.options:
            value = given.get(option, spec.family.default(option))
            if option == "global_bound" and type(value) is int:  # policies and callers write 256
                value = str(value)
            out[option] = _choice(spec, option, value)
        elif option in given and not (option == "scale_rule" and given[option] == NEUTRAL[option]):
            raise ValueError(
                f"{spec.name}: {option}={given[option]!r} applies to {_takers(option)}; "
                f"{spec.name} has no {option} option"
            )
        else:
            out[option] = NEUTRAL[option]
    return out


def resolve(
    fmt: str | FormatSpec | QuantConfig,
    *,
    block_size: int | None = None,
    axis: int | None = -1,
    block_shape: tuple[int, int] | None = None,
    granularity: str | None = None,
    **options: Any,
) -> QuantConfig:
    """Check a request against the registry; raise ValueError naming what is allowed.

    A `QuantConfig` passes through unchanged (no further options allowed)."""
    if isinstance(fmt, QuantConfig):
        given = {k: v for k, v in options.items() if NEUTRAL.get(k) != v}  # keyword defaults
        if (block_size is not None or block_shape is not None or axis != -1 or given
                or granularity is not None):
            raise ValueError(f"{fmt.name}: pass a QuantConfig alone, or a format name with options")
        return fmt
    spec = fmt if isinstance(fmt, FormatSpec) else registry.get(fmt)
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        raise ValueError(f"{spec.name}: axis must be an int, got {axis!r}")
    gran = _granularity(spec, granularity, block_size, block_shape)
    if gran in WHOLE_ROW:
        block, tile = 0, None
    elif gran == "tile":
        block, tile = 0, _tile(spec, spec.tile if block_shape is None else block_shape,
                               block_size, axis)
        axis = -1 if axis is None else axis
    else:
        block, tile = _block_size(spec, block_size), None
    allowed = (*CHOICE_OPTIONS, "zero_saturated_grad", "seed")
    for key in options:
        if key not in allowed:
            takes = tuple(o for o in allowed if o in spec.options or o not in CHOICE_OPTIONS)
            raise ValueError(
                f"{spec.name}: unknown option {key!r}{registry.suggest(key, takes + KEYWORDS)}; "
                f"allowed options: {', '.join(takes)}"
            )
    choices = _choices(spec, {k: v for k, v in options.items() if k in CHOICE_OPTIONS})
    clash = spec.family.check(choices | {"granularity": gran}) if spec.family.check else None
    if clash:
        raise ValueError(f"{spec.name}: {clash}")
    zsg = options.get("zero_saturated_grad", False)
    if not isinstance(zsg, bool):
        raise ValueError(f"{spec.name}: zero_saturated_grad must be True or False, got {zsg!r}")
    seed = options.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"{spec.name}: seed must be an int, got {seed!r}")
    return QuantConfig(spec, block, tile, axis, zero_saturated_grad=zsg, seed=seed,
                       granularity=gran, **choices)
