"""The format registry: one source of truth for every number format.

Passes, metrics, the policy schema and the ONNX exporter all read a format's properties from
here (element grid, max normal, block size rules, allowed options), so adding a format means
adding one entry, not editing every consumer.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

import torch

ScaleKind = Literal["e8m0", "e4m3_fp32", "fp32"]
Family = Literal["mx", "nvfp4", "int"]


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

MX_SCALE_RULES = ("floor", "rceil", "ceil", "even")
ROUNDINGS = ("rne", "rna", "stochastic")
NVFP4_VARIANTS = ("default", "compressed-tensors", "one_level")
POW2_BLOCKS = tuple(2**i for i in range(1, 11))  # 2 .. 1024


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
    options: dict[str, tuple[str, ...]] = field(default_factory=dict)  # option -> allowed values

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


_MX_OPTIONS = {"scale_rule": MX_SCALE_RULES, "rounding": ROUNDINGS}
_REGISTRY: dict[str, FormatSpec] = {}


def register(spec: FormatSpec) -> FormatSpec:
    """Add a format to the registry (names are unique)."""
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


for _name, _elem, _desc in [
    ("mxfp4", E2M1, "OCP MX: FP4 E2M1 elements, E8M0 power-of-two scale per 32"),
    ("mxfp6_e2m3", E2M3, "OCP MX: FP6 E2M3 elements, E8M0 scale per 32"),
    ("mxfp6_e3m2", E3M2, "OCP MX: FP6 E3M2 elements, E8M0 scale per 32"),
    ("mxfp8_e4m3", E4M3, "OCP MX: FP8 E4M3 elements, E8M0 scale per 32"),
    ("mxfp8_e5m2", E5M2, "OCP MX: FP8 E5M2 elements, E8M0 scale per 32"),
    ("mxint8", INT8_MX, "OCP MX: INT8 (1.6 fixed point) elements, E8M0 scale per 32"),
]:
    register(
        FormatSpec(
            name=_name,
            family="mx",
            element=_elem,
            default_block=32,
            scale="e8m0",
            tile=(32, 32),
            onnx_op=_name.upper().replace("_", "") + "FakeQuant",
            description=_desc,
            options=dict(_MX_OPTIONS),
        )
    )

register(
    FormatSpec(
        name="nvfp4",
        family="nvfp4",
        element=E2M1,
        default_block=16,
        scale="e4m3_fp32",
        tile=(16, 16),
        onnx_op="NVFP4FakeQuant",
        description="NVIDIA NVFP4: E2M1 elements, E4M3 scale per 16, fp32 scale per tensor",
        options={"rounding": ROUNDINGS, "nvfp4_variant": NVFP4_VARIANTS},
    )
)
for _name, _elem in [("int4", INT4), ("int8", INT8)]:
    register(
        FormatSpec(
            name=_name,
            family="int",
            element=_elem,
            default_block=128,
            scale="fp32",
            tile=(128, 128),
            onnx_op=_name.upper() + "FakeQuant",
            description=f"symmetric {_name} groups with an fp32 scale per group (amax / {_elem.qmax})",
            allowed_blocks=None,
            options={"rounding": ROUNDINGS},
        )
    )
