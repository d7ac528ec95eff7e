"""Rotate pass: an orthogonal change of basis of a product's reduction axis, before quantization.

Driven by the policy's `rotate` rules. At a selected site the input becomes x·R and the weight
W·R, R applied per block of b consecutive input features (block-diagonal), so the site computes
(x·R)(W·R)ᵀ = x·Wᵀ: the full-precision output is unchanged up to fp32 rounding, while the
fake quantization the `quantize` rules insert later at the same points sees the rotated tensors
(an outlier channel spread over its block). A rule with `weight: "stored"` (a checkpoint whose
weight already holds W·R, compressed-tensors' fused `weight_input` transform) rotates the input
only: the weight point gets nothing. The pass registers before the fake-quant pass, and
an insertion stacks on what came before it (`core/graph.py`), so that order is the contract.

At an attention site (point `query_key`, SpinQuant's R3) the query and the key after RoPE become
q·R and k·R along head_dim, the key as the attention call gets it (every cached token), so
q·kᵀ is unchanged while a key quantizer (a KV cache) sees k·R. Both are rotated every forward;
nothing is cached.

R is `formats.hadamard`'s H_b/sqrt(b) (kind hadamard), diag(signs)·H_b (random_hadamard, signs
from the Philox stream of the rule's seed) or an orthogonal matrix read from a file (matrix).
The rotated weight is computed once per weight version (`core.versions.Watch`, as the fake-quant
cache); under FSDP in every forward, keeping nothing. A rotation is a change of basis, not an
error: the graph's raw value of the point becomes the rotated one (`rebases`), so taps and
shadows measure quantization error against the rotated full-precision tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from qtransform.core import ops
from qtransform.core.phase import in_rollout
from qtransform.core.program import Program
from qtransform.core.rotation import apply_rotation, rotation_operand
from qtransform.core.sharding import sharded
from qtransform.core.sites import ATTENTION_KIND, LINEAR_KINDS, Site
from qtransform.core.versions import Watch
from qtransform.errors import UserError
from qtransform.formats import hadamard
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import select_sites
from qtransform.schemas.sections.rotate import ATTENTION_POINT, RotateRule, rule_label

ORTHOGONAL_TOL = 1e-4  # largest |R·Rᵀ − I| accepted from a matrix file (float64 check)


class Rotate(nn.Module):
    """One point of a site rotated along its reduction axis (`axis`), block by block.

    On a weight (`cache=True`) the rotated copy is kept while the parameter is unchanged
    (`core.versions.Watch`), recomputed under FSDP (`core.sharding.sharded`) and whenever a
    gradient must reach the parameter. Traced (export, compile), it is one
    `qtransform::rotate` op labelled `<site>/<point>_rotate`.
    """

    rebases = True  # a change of basis: the graph's raw value of the point becomes this output

    def __init__(self, kind: str, operand: Tensor, label: str, *, axis: int = -1, cache: bool = False,
                 lora: str = "unrotated", stored_weight: bool = False):
        super().__init__()
        self.kind = kind
        self.lora = lora  # what a PEFT adapter on the site sees: x ("unrotated") or x·R (core/lora.py)
        self.stored_weight = stored_weight  # an input rotation whose weight holds W·R already
        self.register_buffer("operand", operand.to(torch.float32), persistent=False)
        self.block = operand.shape[0]
        self.axis = axis
        self.label = label
        self.cache = cache
        self.enabled = True  # eager only: off, the point passes unrotated (both points of a site)
        self._watch = Watch()
        self._cached: Tensor | None = None

    def extra_repr(self) -> str:
        stored = ", weight stored rotated" if self.stored_weight else ""
        return f"{self.kind}, block={self.block}, axis={self.axis}, label={self.label!r}{stored}"

    def rotate_weight(self, weight: Tensor) -> Tensor:
        """`weight` rotated now, without the cache (dense LoRA weights, rollout weights)."""
        return apply_rotation(weight, self.operand, self.axis) if self.enabled else weight

    def clear_cache(self) -> None:
        self._watch.forget()
        self._cached = None

    def train(self, mode: bool = True) -> Rotate:
        self._watch.recheck()  # a change of mode is a point where every byte is checked
        return super().train(mode)

    def forward(self, x: Tensor) -> Tensor:
        if ops.is_tracing(x):  # the op rotates the last axis: a weight's axis is moved there
            moved = x.movedim(self.axis, -1) if self.axis not in (-1, x.dim() - 1) else x
            out = torch.ops.qtransform.rotate(moved, self.operand.to(x.dtype), self.kind, self.label)
            return out if moved is x else out.movedim(-1, self.axis)
        if not self.enabled:
            return x
        if not self.cache or sharded(self) or (x.requires_grad and torch.is_grad_enabled()):
            self.clear_cache()
            return apply_rotation(x, self.operand, self.axis)
        check = "identity" if in_rollout() else "sample"
        if self._watch.changed(x, check) or self._cached is None:
            try:
                # a normal tensor even under inference_mode: the fake quant after it watches its
                # version counter, which inference tensors do not have
                with torch.inference_mode(False), torch.no_grad():
                    self._cached = apply_rotation(x.detach(), self.operand, self.axis)
            except BaseException:
                self.clear_cache()
                raise
        return self._cached


@dataclass(frozen=True, eq=False)
class Rotation:
    """The payload of one rotate action: the rule, its label and the resolved operand."""

    rule: RotateRule
    where: str  # `rotate[0] 'h32'`
    block: int
    operand: Tensor


def load_matrix(path: str, where: str) -> Tensor:
    """The square orthogonal matrix of a rule's file (.safetensors: its one tensor; .pt/.pth: a
    tensor saved with torch.save), checked; UserError naming the file otherwise."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{where}.matrix: no file {path!r} (relative paths are read from the "
                        f"current directory, {Path.cwd()})")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(file))
            if len(tensors) != 1:
                raise UserError(f"{where}.matrix: {path!r} holds {len(tensors)} tensors "
                                f"({', '.join(sorted(tensors)) or 'none'}); save exactly one")
            (matrix,) = tensors.values()
        else:
            matrix = torch.load(file, map_location="cpu", weights_only=True)
    except UserError:
        raise
    except Exception as exc:  # a corrupt or foreign file: the user's to fix
        raise UserError(f"{where}.matrix: cannot read {path!r}: {exc}") from None
    if not isinstance(matrix, Tensor) or matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
        shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
        raise UserError(f"{where}.matrix: {path!r} must hold one square matrix, got {shape}")
    if not matrix.is_floating_point():
        raise UserError(f"{where}.matrix: {path!r} holds a {matrix.dtype} matrix; a rotation is a float matrix")
    r = matrix.to(torch.float64)
    err = float((r @ r.T - torch.eye(r.shape[0], dtype=torch.float64)).abs().max())
    if not err <= ORTHOGONAL_TOL:
        raise UserError(f"{where}.matrix: {path!r} is not orthogonal (largest |R·Rᵀ − I| = {err:.3g}, "
                        f"more than {ORTHOGONAL_TOL:g}): a rotation must keep x·Wᵀ unchanged")
    return matrix.to(torch.float32)


def in_features(site: Site) -> int:
    """The length of a site's reduction axis (input features of each matrix)."""
    assert site.weight_shape is not None
    return site.weight_shape[site.reduction_axis]


def rotated_axis(site: Site) -> tuple[int, str]:
    """The length of the axis a rotation of `site` acts on and its name in messages: a
    Linear's input features, an attention's head_dim."""
    if site.kind != ATTENTION_KIND:
        return in_features(site), "input features"
    if site.heads is None:
        raise UserError(f"{site.name}: its config does not give head_dim, which a query_key "
                        "rotation acts on; leave this attention out of the rule (ignore)")
    return site.heads[2], "head_dim"


def block_for(rule: RotateRule, where: str, site: Site, matrix: Tensor | None) -> int:
    """The rule's block size at `site`, or a UserError naming the rule's field and the fix."""
    n, axis = rotated_axis(site)
    powers = [1 << k for k in range(1, n.bit_length()) if n % (1 << k) == 0]
    fits = f"block sizes that fit: {', '.join(map(str, powers))}" if powers else "no power of two above 1 divides it"
    if rule.kind == "matrix":
        assert matrix is not None
        size = matrix.shape[0]
        if rule.block_size is not None and rule.block_size != size:
            raise UserError(f"{where}.block_size: {rule.block_size} differs from the {size}×{size} "
                            f"matrix in {rule.matrix!r}; leave it null or set {size}")
        if n % size:
            raise UserError(f"{where} at {site.name}: the {size}×{size} matrix does not divide its "
                            f"{n} {axis}")
        return size
    if rule.block_size is None:
        if not hadamard.is_power_of_two(n):
            raise UserError(f"{where}.block_size: null means the whole axis, but {site.name} has {n} "
                            f"{axis}, not a power of two; set block_size ({fits})")
        return n
    if n % rule.block_size:
        raise UserError(f"{where}.block_size: {rule.block_size} does not divide the {n} {axis} "
                        f"of {site.name}; {fits}")
    return rule.block_size


def site_rotation(rule: RotateRule, where: str, site: Site, matrix: Tensor | None) -> Rotation:
    """The rotation `rule` gives `site` (its block checked against the site's input features)."""
    block = block_for(rule, where, site, matrix)
    return Rotation(rule, where, block, rotation_operand(rule.kind, block, rule.seed, matrix))


def resolve_rotations(rules: list[RotateRule], sites: list[Site]) -> dict[str, Rotation]:
    """Site name -> the rotation its weight gets among `sites` (the last rule naming a site
    wins), without the pass's "matched nothing" checks: what a weight scan of a checkpoint
    measures. A site whose rule says `weight: "stored"` is left out: its weight holds W·R
    already and is measured as it is."""
    chosen: dict[str, Rotation] = {}
    for i, rule in enumerate(rules):
        if rule.point == ATTENTION_POINT:
            continue  # no weight
        where = rule_label(i, rule)
        selector = rule.selector()
        matched = [s for s in sites if s.kind in LINEAR_KINDS and s.weight_shape is not None and selector.matches(s)]
        matrix = load_matrix(rule.matrix, where) if rule.kind == "matrix" and matched else None
        for site in matched:
            chosen[site.name] = site_rotation(rule, where, site, matrix)
    return {name: r for name, r in chosen.items() if r.rule.weight == "rotate"}


@register_pass
class RotatePass(Pass[list[RotateRule], Rotation]):
    """Inserts `Rotate` on the input and the weight of every Linear site the `rotate` rules
    select (the input only where the rule's weight is "stored"), and on the query and the key of
    every attention site a query_key rule selects."""

    name = "rotate"
    tag = "rotate"
    section = "rotate"
    provides = (name,)

    def select(self, program: Program, spec: list[RotateRule]) -> list[Action[Rotation]]:
        """One (weight, input) or (query, key) pair of actions per selected site, the last rule
        naming a site winning; every block size and matrix file is checked before anything is
        built."""
        chosen: dict[str, tuple[Site, Rotation]] = {}
        for i, rule in enumerate(spec):
            where = rule_label(i, rule)
            matrix = load_matrix(rule.matrix, where) if rule.kind == "matrix" else None
            attention = rule.point == ATTENTION_POINT
            for site in select_sites(program, rule, where, kinds=(ATTENTION_KIND,) if attention else LINEAR_KINDS):
                if site.weight_shape is None and not attention:
                    continue
                if program.mode == "graph" and site.kind == "experts":
                    raise UserError(f"{where}: {site.name} is a fused experts parameter, whose input the "
                                    "whole-model graph does not expose; rotate it in module mode (the "
                                    "default) or add it to the rule's ignore")
                chosen[site.name] = (site, site_rotation(rule, where, site, matrix))
        actions = []
        for site, rotation in chosen.values():
            if site.kind == ATTENTION_KIND:
                actions += [Action(site, point, rotation.where, rotation) for point in ("query", "key")]
                continue
            if rotation.rule.weight == "rotate":
                actions.append(Action(site, "weight", rotation.where, rotation))
            actions.append(Action(site, "input", rotation.where, rotation))
        return actions

    def build(self, program: Program, action: Action[Rotation]) -> nn.Module:
        site, rotation = action.site, action.payload
        weight = action.point == "weight"
        return Rotate(rotation.rule.kind, rotation.operand, self.label(site.name, action.point),
                      axis=site.reduction_axis if weight else -1, cache=weight, lora=rotation.rule.lora,
                      stored_weight=rotation.rule.weight == "stored")

    def describe(self, action: Action[Rotation]) -> str:
        rule = action.payload.rule
        extra = (f", seed={rule.seed}" if rule.kind == "random_hadamard"
                 else f", matrix={rule.matrix}" if rule.kind == "matrix" else "")
        adapters = ", LoRA sees it" if rule.lora == "rotated" and action.point == "input" else ""
        stored = ", weight stored rotated" if rule.weight == "stored" else ""
        axis = " along head_dim" if rule.point == ATTENTION_POINT else ""
        return f"{rule.kind} block={action.payload.block}{axis}{extra}{adapters}{stored}"
