"""The format registry: one source of truth for every number format and format family.

Passes, metrics, the policy schema and the ONNX exporter all read a format's properties from
here (element grid, max normal, block size rules, allowed options), so adding a format means
adding one entry, not editing every consumer. A `Family` is one record per scaling scheme (MX,
NVFP4, int groups): its options and their defaults, its reference kernel and its fast-kernel id.
Each family module (`mx.py`, `nvfp4.py`, `intgroup.py`) registers its family and formats; the
ONNX half of a family (function body, QDQ form) is registered by `qtransform.export`, one layer
up, under the same family name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from qtransform.formats.blocking import BlockQuant
    from qtransform.formats.options import QuantConfig

# what a format stores beside its elements: an E8M0 or fp32 scale per block, an E4M3 scale per
# block times an fp32 one per tensor, or one fp32 scale per tensor only (no block scales)
ScaleKind = Literal["e8m0", "e4m3_fp32", "fp32", "fp32_tensor"]


@dataclass(frozen=True)
class ElementSpec:
    """An element type: a small float (sign, ebits, mbits) or a symmetric fixed-point/int grid."""

    name: str
    kind: Literal["float", "int"]
    ebits: int
    mbits: int
    emax: int  # exponent of the largest power of two (floor_log2(max_normal))
    emin: int  # exponent of the smallest normal (1 - bias); subnormal step is 2^(emin - mbits)
    max_normal: float
    qmax: int = 0  # int elements: largest integer code (values are code * step)
    step: float = 1.0  # int elements: value of one integer code

    @property
    def bits(self) -> int:
        """Width of one element code including the sign bit (int elements: sign-magnitude)."""
        if self.kind == "float":
            return 1 + self.ebits + self.mbits
        return 1 + self.qmax.bit_length()

    def grid(self) -> torch.Tensor:
        """All non-negative representable values, ascending (fp32, on the CPU)."""
        if self.kind == "int":
            return torch.arange(self.qmax + 1, dtype=torch.float32) * self.step
        vals = {0.0}
        sub_step = 2.0 ** (self.emin - self.mbits)
        for m in range(1, 2**self.mbits):
            vals.add(m * sub_step)
        for e in range(self.emin, self.emax + 1):
            for m in range(2**self.mbits):
                v = (1 + m / 2**self.mbits) * 2.0**e
                if v <= self.max_normal:
                    vals.add(v)
        return torch.tensor(sorted(vals), dtype=torch.float32)


E2M1 = ElementSpec("e2m1", "float", 2, 1, emax=2, emin=0, max_normal=6.0)
E2M3 = ElementSpec("e2m3", "float", 2, 3, emax=2, emin=0, max_normal=7.5)
E3M2 = ElementSpec("e3m2", "float", 3, 2, emax=4, emin=-2, max_normal=28.0)
E4M3 = ElementSpec("e4m3", "float", 4, 3, emax=8, emin=-6, max_normal=448.0)
E5M2 = ElementSpec("e5m2", "float", 5, 2, emax=15, emin=-14, max_normal=57344.0)
INT8_MX = ElementSpec("int8_mx", "int", 0, 6, emax=0, emin=0, max_normal=127 / 64, qmax=127, step=1 / 64)
INT4 = ElementSpec("int4", "int", 0, 0, emax=0, emin=0, max_normal=7.0, qmax=7)
INT8 = ElementSpec("int8", "int", 0, 0, emax=0, emin=0, max_normal=127.0, qmax=127)
SCALE_DTYPES = ("float32", "bfloat16", "float16", "input")  # fp32-scaled families' scale dtype
SCALE_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ROUNDINGS = ("rne", "rna", "rtz", "stochastic")  # every family's element rounding
# what one scale covers: a 1D block along an axis, a whole row of a weight (one scale per output
# channel) or of an activation (per token), the whole tensor, or a 2D tile of the last two dims
GRANULARITIES = ("block", "channel", "token", "tensor", "tile")
BLOCKED = ("block", "tile")  # the granularities of block formats whose scales cover few elements
POW2_BLOCKS = tuple(2**i for i in range(1, 11))  # 2 .. 1024


def _never(cfg: QuantConfig) -> bool:  # noqa: ARG001
    return False


@dataclass(frozen=True, eq=False)  # one object per family: compared and hashed by identity
class Family:
    """One scaling scheme shared by several formats: everything that is not the element type.

    `options` maps each choice option the family takes to its allowed values, the first being
    the default. `quantize(blocks, cfg, u, amax_t, scale_t)` is the reference kernel on [n, block]
    fp32 blocks (`u`: the stochastic-rounding uniforms; `amax_t`: the tensor's amax when
    `per_tensor(cfg)`, else None; `scale_t`, an optional fifth argument passed only when given:
    instead of `amax_t`, a stored tensor-level scale used as it is, never recomputed from an
    amax; a family without it takes no stored scale). `kernel_id` names the family in the compiled kernels
    (`qfast.c`, `triton_kernels.py`); None leaves its formats on the reference path.
    `exponents` (power-of-two families) turns a block result into per-block shared exponents,
    and `scale_values(scales, tensor_scale, cfg)` decodes stored scales into fp32 multipliers.
    `granularities` are what one of its scales may cover (`GRANULARITIES`): a family whose
    scale is a plain fp32 number takes them all; E8M0 and E4M3 block scales only blocks/tiles.
    `quiet` options are spelled out only when they differ from their default, so the configs,
    plans and ONNX attributes written before the family took them stay as they were.
    `check(choices)` names a combination of choice values the family cannot compute.
    For "channel", "token" and "tensor" the kernel sees whole rows as blocks; "tensor" also gets
    the tensor's amax (`per_tensor` is true for it) and uses it for every row.
    """

    name: str
    options: dict[str, tuple[str, ...]]
    quantize: Callable[[torch.Tensor, QuantConfig, torch.Tensor | None, torch.Tensor | None,
                        torch.Tensor | None], BlockQuant]
    scale_values: Callable[[torch.Tensor, torch.Tensor | None, QuantConfig], torch.Tensor]
    per_tensor: Callable[[QuantConfig], bool] = _never
    exponents: Callable[[BlockQuant], torch.Tensor] | None = None
    kernel_id: int | None = None
    granularities: tuple[str, ...] = BLOCKED
    check: Callable[[dict[str, str]], str | None] | None = None  # choices -> what clashes, or None
    quiet: tuple[str, ...] = ()  # options left out of numerics() at their default (added later)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def __reduce__(self) -> tuple:
        """Pickled by name (its kernels are functions of its module): a pickled config loads
        as the registered family of this process."""
        return family, (self.name,)

    def default(self, option: str) -> Any:
        """The default value of a choice option of this family."""
        return self.options[option][0]


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family (names are unique); its formats are registered after it."""
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def family(name: str) -> Family:
    """A registered family by name."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown format family {name!r}; registered: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def families() -> tuple[Family, ...]:
    """Registered families, in registration order."""
    return tuple(_FAMILIES.values())


@dataclass(frozen=True)
class FormatSpec:
    """A block format: element type, block/scale structure and the options it accepts."""

    name: str
    family: Family
    element: ElementSpec
    default_block: int
    scale: ScaleKind
    tile: tuple[int, int]  # default 2D tile for weights (block_shape)
    onnx_op: str  # op_type of the custom-domain node in exported graphs
    description: str
    allowed_blocks: tuple[int, ...] | None = POW2_BLOCKS  # None: any positive integer

    @property
    def options(self) -> dict[str, tuple[str, ...]]:
        """Choice option -> allowed values (the first is the default): the family's."""
        return self.family.options

    @property
    def max_normal(self) -> float:
        return self.element.max_normal

    def grid(self) -> torch.Tensor:
        return self.element.grid()

    def check_block(self, block: int) -> None:
        """Raise a ValueError naming the allowed block sizes if `block` is not one of them."""
        if self.allowed_blocks is None:
            if not (isinstance(block, int) and block > 0):
                raise ValueError(f"{self.name}: block size must be a positive integer, got {block!r}")
        elif block not in self.allowed_blocks:
            raise ValueError(
                f"{self.name}: block size {block!r} is not allowed; "
                f"allowed: {', '.join(map(str, self.allowed_blocks))} (default {self.default_block})"
            )


_REGISTRY: dict[str, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    """Add a format to the registry (names are unique; its family registered first)."""
    if _FAMILIES.get(spec.family.name) is not spec.family:
        raise ValueError(f"format {spec.name!r}: register family {spec.family.name!r} first")
    if spec.name in _REGISTRY:
        raise ValueError(f"format {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def names() -> tuple[str, ...]:
    """Registered format names, in registration order."""
    return tuple(_REGISTRY)


def suggest(name: str, choices: tuple[str, ...] | list[str]) -> str:
    """A ' (did you mean X?)' hint for a misspelt name, or ''."""
    close = difflib.get_close_matches(str(name).lower(), list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get(name: str) -> FormatSpec:
    """Look up a format by name; unknown names raise a ValueError listing the registered ones."""
    key = str(name).lower()
    if key in _REGISTRY:
        return _REGISTRY[key]
    raise ValueError(
        f"unknown format {name!r}{suggest(key, names())}; registered formats: {', '.join(names())}"
    )
