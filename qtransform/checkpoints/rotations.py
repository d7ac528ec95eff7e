"""Online rotations in a compressed-tensors checkpoint (its `transform_config`), opened where
qtransform reproduces them exactly.

llm-compressor's QuIP modifier, and qtransform's own export of a policy's `rotate` section, write
per group `type` "hadamard" (no random permutation), a block `head_dim`, and the pair online
`input` (x·H_b/√b, which an engine runs) and inverse `weight_input` (fused at save: the stored
weight is W·R already). llm-compressor's SpinQuant R3 (and qtransform's rotate point
`query_key`) writes the pair `q_attn` and `k_cache` on attention modules: the query and the key
after RoPE rotated online along head_dim, nothing fused. `parse` reads the groups or refuses what
it cannot reproduce (random signs or matrices, output-side locations, half pairs,
reduced-precision online rotations); `bind` finds each group's modules in the model as
compressed-tensors matches them; `check_matrix` checks the online matrices llm-compressor saves
beside the weights (`<module>.<group>_input.weight`, `<module>.<group>_q_attn.weight`), which
the reader then drops. The policy rotates those inputs only (rotate rule `weight: "stored"`)
and those queries and keys (point `query_key`; `checkpoints.policy`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from qtransform.checkpoints.matching import ct_matches
from qtransform.core.attention import attention_heads, is_attention
from qtransform.errors import UserError
from qtransform.formats.hadamard import hadamard_matrix, is_power_of_two

# online rotation precisions opened: qtransform's own fp32, and float64 (QuIP's default: the same
# bf16 logits in tests_llmc, fp32 rounding apart in an fp32 model); bf16/fp16 round x first
ROTATION_PRECISIONS = ("torch.float32", "torch.float64")
LINEAR_PAIR = [("input", False), ("weight_input", True)]
ATTENTION_PAIR = [("k_cache", False), ("q_attn", False)]


@dataclass(frozen=True)
class RotationGroup:
    """One transform_config group qtransform reproduces: a Hadamard rotation H_b/√b of its
    modules' inputs, online, whose inverse is fused into their stored weights (W·R); or (point
    "query_key") of its attention modules' queries and keys, online."""

    name: str
    block: int | None  # head_dim; None: the whole input axis (the whole head_dim)
    targets: tuple[str, ...]
    ignore: tuple[str, ...]
    point: str = "input"  # or "query_key"

    def locations(self) -> tuple[str, ...]:
        """The online locations, whose matrix llm-compressor saves under the first one."""
        return ("q_attn", "k_cache") if self.point == "query_key" else ("input",)


def _names(value: object, where: str) -> tuple[str, ...]:
    """A TransformArgs targets / ignore field (a string or a list of strings)."""
    items = [value] if isinstance(value, str) else value or []
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise UserError(f"{where}: must be a module name or a list of them, not {value!r}")
    return tuple(items)


def parse(where: str, tc: object) -> list[RotationGroup]:
    """The rotations of a transform_config, or a refusal naming the group and why qtransform
    cannot reproduce it."""
    if not tc:
        return []
    groups = tc.get("config_groups") if isinstance(tc, dict) else None
    if not isinstance(groups, dict):
        raise UserError(f"{where}: no config_groups object; not a compressed-tensors transform config")
    out = []
    for name, g in sorted(groups.items()):
        at = f"{where} group {name!r}"
        kind = g.get("type") if isinstance(g, dict) else None
        if kind in ("random-hadamard", "random-matrix"):
            raise UserError(f"{at}: type {kind!r}, whose matrices compressed-tensors draws from "
                            "torch's generator when it loads the model; qtransform reproduces "
                            "type 'hadamard' only")
        if kind != "hadamard":
            raise UserError(f"{at}: transform type {kind!r}, which qtransform does not know "
                            "(it reproduces type 'hadamard')")
        if g.get("randomize"):
            raise UserError(f"{at}: randomize true (a permutation drawn from torch's generator), "
                            "which qtransform does not reproduce")
        precision = g.get("precision", "torch.float32")
        if precision not in ROTATION_PRECISIONS:
            raise UserError(f"{at}: online rotations in {precision}, which rounds the input before "
                            "rotating it; qtransform rotates in float32 (it reads "
                            f"{', '.join(ROTATION_PRECISIONS)})")
        block = g.get("head_dim")
        if block is not None and (not isinstance(block, int) or block < 2 or not is_power_of_two(block)):
            raise UserError(f"{at}: head_dim {block!r}; a Hadamard block is a power of two")
        applies = g.get("apply") or []
        if not isinstance(applies, list) or not all(isinstance(a, dict) for a in applies):
            raise UserError(f"{at}: apply must be a list of objects")
        locations = [(a.get("location"), bool(a.get("inverse", False))) for a in applies]
        attention = any(loc in ("q_attn", "k_cache") for loc, _ in locations)
        other = [loc for loc, _ in locations if loc not in ("input", "weight_input", "q_attn", "k_cache")]
        if other:
            raise UserError(f"{at}: location {other[0]!r}; qtransform reproduces rotations of a "
                            "Linear's input (the pair 'input' online, 'weight_input' inverse fused) "
                            "and of an attention's query and key (the pair 'q_attn', 'k_cache')")
        have = ", ".join(f"{loc}{' inverse' if inv else ''}" for loc, inv in locations) or "nothing"
        if attention and sorted(locations) != ATTENTION_PAIR:
            raise UserError(f"{at}: applies {have}; qtransform reproduces the query and key "
                            "rotations as exactly the pair 'q_attn' and 'k_cache' (online, not "
                            "inverse): one without the other changes q·kᵀ")
        if not attention and sorted(locations) != LINEAR_PAIR:
            raise UserError(f"{at}: applies {have}; qtransform reproduces exactly the pair 'input' "
                            "(online) and 'weight_input' inverse (fused into the stored weight): "
                            "an online rotation without its fused inverse, or the other way round, "
                            "changes the model's function")
        first, second = sorted(applies, key=lambda a: a.get("location") not in ("input", "q_attn"))
        targets = _names(first.get("targets"), f"{at} targets")
        ignore = _names(first.get("ignore"), f"{at} ignore")
        if not targets:
            raise UserError(f"{at}: no targets")
        if (_names(second.get("targets"), at), _names(second.get("ignore"), at)) != (targets, ignore):
            raise UserError(f"{at}: its two locations name different modules; "
                            + ("the query and the key of an attention are rotated together" if attention
                               else "each online rotation needs its fused inverse on the same module"))
        out.append(RotationGroup(str(name), block, targets, ignore, "query_key" if attention else "input"))
    return out


def bind(rotations: list[RotationGroup], modules: Iterable[tuple[str, Any]]) -> dict[str, list[str]]:
    """The modules each rotation group applies to in the model, checked: an nn.Linear, a block
    that divides its input features, one group per module."""
    owner: dict[str, str] = {}
    rotated: dict[str, list[str]] = {}
    pairs = list(modules) if rotations else []
    for g in rotations:
        hits = [(n, m) for n, m in pairs if any(ct_matches(t, n, type(m).__name__) for t in g.targets)
                and not any(ct_matches(i, n, type(m).__name__) for i in g.ignore)]
        at = f"transform_config group {g.name!r}"
        if not hits:
            raise UserError(f"{at}: its targets {list(g.targets)} match no module of the model")
        for n, m in hits:
            features, axis = _axis(g, at, n, m)
            if g.block is None and not is_power_of_two(features):
                raise UserError(f"{at}: no head_dim, so the whole axis of {n}, whose {features} "
                                f"{axis} are not a power of two")
            if g.block is not None and features % g.block:
                raise UserError(f"{at}: head_dim {g.block} does not divide the {features} {axis} of {n}")
            if n in owner:
                raise UserError(f"{at} and group {owner[n]!r} both rotate {n}; qtransform "
                                "reproduces one rotation per module")
            owner[n] = g.name
        rotated[g.name] = [n for n, _ in hits]
    return rotated


def _axis(group: RotationGroup, at: str, name: str, module: Any) -> tuple[int, str]:
    """The length of the axis `group` rotates in `module` and its name, or a UserError."""
    if group.point == "query_key":
        heads = attention_heads(module) if is_attention(module) else None
        if heads is None:
            raise UserError(f"{at} rotates the query and key of {name} ({type(module).__name__}), "
                            "which is not an attention module whose config gives its head_dim")
        return heads[2], "head_dim"
    if not isinstance(module, torch.nn.Linear):
        raise UserError(f"{at} rotates {name} ({type(module).__name__}); qtransform reproduces "
                        "rotations of nn.Linear inputs and of attention queries and keys only")
    return module.in_features, "input features"


def check_matrix(group: RotationGroup, name: str, t: Tensor) -> None:
    """A stored online matrix must be the unnormalized Sylvester H_b the config names."""
    n = t.shape[0] if t.dim() == 2 and t.shape[0] == t.shape[1] else 0
    ok = n > 1 and is_power_of_two(n) and group.block in (None, n) and t.is_floating_point()
    if not ok or not torch.equal(t.to(torch.float64), torch.sign(hadamard_matrix(n, torch.float64))):
        raise UserError(f"{name}: the stored matrix of transform group {group.name!r} (shape "
                        f"{list(t.shape)}) is not the Hadamard matrix its config names; another "
                        "rotation, which qtransform does not reproduce")
