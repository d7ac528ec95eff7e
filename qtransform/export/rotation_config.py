"""compressed-tensors' `transform_config` for a policy's rotations (the checkpoint's rotations).

compressed-tensors 0.19 (`compressed_tensors.transform`) describes rotations as a
`TransformConfig`: named `TransformScheme`s with a `type` ("hadamard", "random-hadamard",
"random-matrix"), a block size `head_dim`, and `apply` locations per module list. A
qtransform rotation at a Linear's `input` point is the pair its QuIP modifier writes:
`location: "input"` (online: the engine rotates x per block, x·H_b/√b) and
`location: "weight_input"` with `inverse: true` (offline: the checkpoint's weight is W·(H_b/√b)⁻ᵀ
= W·H_b/√b, already fused, which is what qtransform's rotated, fake-quantized weight is).

A rotation of an attention's query and key (rotate point `query_key`, SpinQuant's R3) is the
pair llm-compressor's SpinQuant modifier writes for R3: `location: "q_attn"` and `location:
"k_cache"`, both online, on the attention modules (compressed-tensors hooks the query the
attention call gets and the key as the KV cache stores it, both after RoPE), `head_dim` = the
block along head_dim.

What it can express: kind `hadamard` on nn.Linear sites and attention modules (Sylvester order,
the same matrix). What
it cannot, refused with a UserError naming the rule and the reason: `random_hadamard`
(compressed-tensors draws its signs from torch's generator, qtransform from its Philox stream:
the same kind, other signs), `matrix` (no scheme carries a given matrix; `random-matrix` draws
its own), and sites that are not nn.Linear in compressed-tensors' sense (fused MoE experts,
GPT-2's Conv1D). The dict is plain JSON (no compressed-tensors import); tests_llmc validates it
with compressed-tensors' own model and applies it.
"""

from __future__ import annotations

from typing import Any

from qtransform.core.program import Program
from qtransform.errors import UserError
from qtransform.passes import RotatePass
from qtransform.passes.rotate import Rotation
from qtransform.schemas import PolicyLike, load_policy

PRECISION = "torch.float32"  # the online rotation's precision: qtransform rotates in fp32
ATTENTION_LOCATIONS = ("q_attn", "k_cache")  # where compressed-tensors rotates the query and key


def scheme(block: int, names: list[str]) -> dict[str, Any]:
    """One config group: the online input rotation and its inverse fused into the weight."""
    return {"type": "hadamard", "head_dim": block, "randomize": False, "requires_grad": False,
            "precision": PRECISION,
            "apply": [{"targets": names, "location": "input", "inverse": False, "ignore": []},
                      {"targets": names, "location": "weight_input", "inverse": True, "ignore": []}]}


def attention_scheme(block: int, names: list[str]) -> dict[str, Any]:
    """One config group: the query and the key of attention modules rotated online, together."""
    return {"type": "hadamard", "head_dim": block, "randomize": False, "requires_grad": False,
            "precision": PRECISION,
            "apply": [{"targets": names, "location": location, "inverse": False, "ignore": []}
                      for location in ATTENTION_LOCATIONS]}


def _check(rotation: Rotation, site_kind: str, site: str) -> None:
    rule = rotation.rule
    if rule.kind == "random_hadamard":
        raise UserError(f"{rotation.where}: compressed-tensors cannot express kind 'random_hadamard': its "
                        "random-hadamard draws the signs from torch's generator, qtransform's from its "
                        "Philox stream (other signs); use kind 'hadamard' for a compressed-tensors checkpoint")
    if rule.kind == "matrix":
        raise UserError(f"{rotation.where}: compressed-tensors cannot express kind 'matrix' (no transform "
                        "scheme carries a given matrix; its random-matrix draws its own)")
    if site_kind not in ("linear", "attention"):
        raise UserError(f"{rotation.where} rotates {site} ({site_kind}); compressed-tensors' transforms apply "
                        "to nn.Linear modules only: leave it out of the rule (ignore) for this checkpoint")


def transform_config(policy: PolicyLike, program: Program) -> dict[str, Any] | None:
    """The `transform_config` (compressed-tensors' TransformConfig as JSON) of the policy's
    rotations on `program`'s sites; None when the policy rotates nothing.

    One config group per (rule, block size), named after the rule (`name`, else `rotate_<i>`),
    listing its sites by module name: Linears at `input` / `weight_input`, attention modules at
    `q_attn` / `k_cache`. Raises UserError for a rotation compressed-tensors cannot
    express (see the module docstring).
    """
    rules = load_policy(policy).rotate
    if not rules:
        return None
    groups: dict[tuple[str, int], tuple[str, list[str]]] = {}
    attention: set[str] = set()  # the groups of query_key rules
    for action in RotatePass().select(program, rules):
        if action.point not in ("input", "query"):
            continue
        rotation = action.payload
        _check(rotation, action.site.kind, action.site.name)
        index = next(i for i, r in enumerate(rules) if r is rotation.rule)
        key = (rotation.where, rotation.block)
        base = rotation.rule.name or f"rotate_{index}"
        groups.setdefault(key, (base, []))[1].append(action.site.name)
        if action.point == "query":
            attention.add(rotation.where)
    config: dict[str, Any] = {}
    for (where, block), (base, names) in groups.items():
        name = base if base not in config else f"{base}_{block}"
        config[name] = (attention_scheme if where in attention else scheme)(block, names)
    return {"config_groups": config}
