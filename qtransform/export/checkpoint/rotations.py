"""Where rotations enter a checkpoint: compressed-tensors' `transform_config`.

A rotated Linear (the rotate pass: x·R online, W·R fused) is stored as compressed-tensors stores
llm-compressor's QuIP transforms: the weight already rotated and quantized (`source.py`), and a
config group per rotation with the `input` (online, the engine rotates x) and `weight_input`
(inverse, already fused) locations (`export.rotation_config.transform_config`, whose docstring
says what compressed-tensors can express). Beside the config, llm-compressor's `save_pretrained`
writes each online transform's matrix once, under the first module that uses it
(`<module>.<group>_input.weight`: the unnormalized Sylvester H_b), which vLLM's transform layers
load; `transform_tensors` writes the same.

An attention whose query and key are rotated (SpinQuant's R3) is a group at `q_attn` and
`k_cache` (online both); llm-compressor saves its matrix once, as `<module>.<group>_q_attn.weight`
(the two locations share it).

With a policy (a plain model transformed by `export_checkpoint`) the config is
`transform_config(policy, program)`; for a model transformed beforehand it is read back from the
inserted `Rotate` modules (kind, block), one group per block size and kind of site.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qtransform.core.program import Program
from qtransform.errors import UserError
from qtransform.export.checkpoint.collect import Collected
from qtransform.export.rotation_config import (
    ATTENTION_LOCATIONS,
    PRECISION,
    attention_scheme,
    scheme,
    transform_config,
)
from qtransform.formats import hadamard
from qtransform.schemas import PolicyLike

_DTYPES = {"torch.float32": torch.float32, "torch.float64": torch.float64,
           "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}


def rotation_config(collected: Collected, policy: PolicyLike | None = None, program: Program | None = None) -> dict[str, Any] | None:
    """compressed-tensors' `transform_config` of the rotations the collected Linears and
    attention modules run, or None; a UserError (before any file is written) for one it cannot
    express."""
    rotated = {name: e.rotation for name, e in collected.linears.items() if e.rotation is not None}
    attention = {name: _query_key(name, e.rotations) for name, e in collected.attention.items() if e.rotations}
    if not rotated and not attention:
        return None
    if policy is not None and program is not None:
        return transform_config(policy, program)
    groups: dict[str, dict[str, Any]] = {}
    for prefix, make, members in (("rotate", scheme, rotated), ("rotate_query_key", attention_scheme, attention)):
        blocks: dict[int, list[str]] = {}
        for name, rotation in members.items():
            _hadamard(name, rotation.kind)
            blocks.setdefault(rotation.block, []).append(name)
        groups.update({f"{prefix}_{block}": make(block, names) for block, names in blocks.items()})
    return {"config_groups": groups}


def _hadamard(name: str, kind: str) -> None:
    if kind != "hadamard":
        why = ("its random_hadamard draws the signs from torch's generator, qtransform's from "
               "its Philox stream (other signs)" if kind == "random_hadamard"
               else "no transform scheme carries a given matrix")
        raise UserError(f"{name}: compressed-tensors cannot express a {kind!r} rotation "
                        f"({why}); rotate with kind 'hadamard' for a compressed-tensors checkpoint")


def _query_key(name: str, rotations: dict[str, Any]) -> Any:
    """The one rotation of an attention's query and key (both, the same), or a UserError."""
    query, key = rotations.get("query"), rotations.get("key")
    if query is None or key is None or (query.kind, query.block) != (key.kind, key.block):
        raise UserError(f"{name}: its query and key are not rotated alike; a checkpoint's q_attn / "
                        "k_cache transform rotates both with one matrix (switch both on or both off)")
    return query


def transform_tensors(config: dict[str, Any] | None) -> dict[str, Tensor]:
    """The online transforms' matrices as llm-compressor saves them: per config group and
    block size one unnormalized Sylvester H_b in the group's precision, named after the first
    module it applies to and its first online location (`<module>.<group>_input.weight`,
    `<module>.<group>_q_attn.weight`)."""
    out: dict[str, Tensor] = {}
    for group, body in (config or {}).get("config_groups", {}).items():
        online = next(a for a in body["apply"] if a["location"] in ("input", *ATTENTION_LOCATIONS))
        block = body["head_dim"]
        dtype = _DTYPES[body.get("precision", PRECISION)]
        matrix = torch.sign(hadamard.hadamard_matrix(block, torch.float64)).to(dtype)
        out[f"{online['targets'][0]}.{group}_{online['location']}.weight"] = matrix
    return out
