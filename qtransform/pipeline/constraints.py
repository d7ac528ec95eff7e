"""A preset's stack constraints checked on the sites its rules select.

A preset reproduces what its stack computes; where the stack refuses a model (compressed-tensors
will not quantize, save or run a Linear whose input features its groups do not divide), a
simulation of that preset describes a model no engine serves. The preset declares such
constraints as data (`schemas.presets.Constraint`); this module implements each named check and
turns a site that breaks one into a one-line UserError naming the module, its shape, what the
stack says, and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from qtransform.core.sites import Site
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.schemas import QuantRule
from qtransform.schemas.presets import constraints_of


def _matrix(site: Site) -> tuple[int, int] | None:
    """(output features, input features) of a site's weight matrix (each expert's), if known."""
    if not site.weight_shape or len(site.weight_shape) < 2:
        return None
    rows, cols = site.weight_shape[-2:]
    return (cols, rows) if site.reduction_axis in (0, -2) else (rows, cols)


def _divisor(n: int, block: int) -> int:
    """The largest power of two below `block` that divides n (1 at worst): a block to suggest."""
    size = 1
    while size * 2 < block and n % (size * 2) == 0:
        size *= 2
    return size


def groups_divide(site: Site, tensor: str, cfg: QuantConfig) -> tuple[str, str] | None:
    """(what does not divide, the fix) where the 1D groups of `cfg` along the input features
    (a weight's reduction axis, an input's last axis) do not divide them; None when they do or
    the rule has no such groups. compressed-tensors refuses such groups (2D weight blocks it
    pads, so they are no constraint)."""
    shape = _matrix(site)
    along_inputs = cfg.axis is None or (tensor == "input" and cfg.axis == -1)
    if shape is None or not along_inputs or cfg.tile or cfg.granularity != "block":
        return None
    n = shape[1]
    if n % cfg.block == 0:
        return None
    return (f"its {n} input features are not a multiple of the group size {cfg.block}",
            f"set a block_size that divides {n} (such as {_divisor(n, cfg.block)})")


CHECKS: dict[str, Callable[[Site, str, QuantConfig], tuple[str, str] | None]] = {
    "groups_divide": groups_divide,
}


def check_constraints(site: Site, tensor: str, rule: QuantRule, where: str) -> None:
    """Raise a UserError where the preset rule `rule` (selected for this site's `tensor`) breaks
    a constraint of its preset's stack; nothing for other rules."""
    for constraint in constraints_of(rule.name):
        found = CHECKS[constraint.check](site, tensor, rule.config())
        if found is None:
            continue
        problem, fix = found
        shape = list(site.weight_shape or ())
        raise UserError(
            f"{where} {rule.name!r}: {site.name} (weight {shape}) cannot be quantized as its stack "
            f"does: {problem} ({constraint.stack_says}); ignore the module (add it to the rule's "
            f"ignore list) or {fix}")
