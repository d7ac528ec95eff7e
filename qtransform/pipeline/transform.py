"""`transform()` and `plan()`: a policy applied to a model, or what applying it would do."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from qtransform.core.capture import capture
from qtransform.core.lora import watch_lora
from qtransform.core.phase import mark_rollout_generate
from qtransform.core.plan import Plan, PlanRow
from qtransform.core.program import Program
from qtransform.core.sharding import check_unwrapped
from qtransform.core.shortcut import install_shortcuts
from qtransform.pipeline.base import Pass, registered_passes
from qtransform.pipeline.manager import PassManager
from qtransform.schemas import Policy, load_policy

PolicyLike = Policy | dict | str | Path


def transform(
    model: nn.Module,
    policy: PolicyLike,
    example_inputs: Any = None,
    *,
    inplace: bool = False,
    mode: str = "module",
    passes: Iterable[Pass] | None = None,
) -> nn.Module:
    """Apply a policy to a model and return the transformed model.

    Args:
        model: any `nn.Module` (a transformers model, a PEFT model, a plain torch model).
        policy: a `Policy`, a dict, JSON text or a path to a JSON file.
        example_inputs: inputs for a whole-model capture (`torch.export`); needed for
            `mode="graph"` and for attention-matmul sites.
        inplace: transform `model` itself instead of a deep copy (saves memory on large models);
            if the transform raises, the model is put back exactly as it was. By default the
            caller's model is left untouched.
        mode: `"module"` keeps the user's model and class (each site module runs its own graph);
            `"graph"` returns the whole-model graph module.
        passes: the passes to run; default: every registered pass.

    Example::

        model = qtransform.transform(model, {"version": 1, "quantize": [
            {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]})
    """
    return transform_program(model, policy, example_inputs, inplace=inplace, mode=mode, passes=passes).module()


def transform_program(
    model: nn.Module,
    policy: PolicyLike,
    example_inputs: Any = None,
    *,
    inplace: bool = False,
    mode: str = "module",
    passes: Iterable[Pass] | None = None,
) -> Program:
    """`transform`, returning the `Program` (site table, graphs, insertion log, plan rows);
    `.module()` of it is what `transform` returns. Arguments as for `transform`."""
    check_unwrapped(model)
    policy = load_policy(policy)
    manager = PassManager(list(passes) if passes is not None else registered_passes())
    work = model if inplace else copy.deepcopy(model)
    program = capture(work, example_inputs, mode=mode)
    try:
        manager.run(program, policy)
    except BaseException:
        program.restore()  # inplace: the caller's model exactly as it was
        raise
    if mode == "module":
        mark_rollout_generate(work)
        watch_lora(work)
    install_shortcuts(program.module())
    return program


def plan(model: nn.Module, policy: PolicyLike, example_inputs: Any = None,
         passes: Iterable[Pass] | None = None) -> Plan:
    """What `transform` would do, without doing it: every site with its selecting rules."""
    policy = load_policy(policy)
    manager = PassManager(list(passes) if passes is not None else registered_passes())
    program = capture(model, example_inputs)
    selected = manager.select(program, policy)
    rows = [PlanRow(a.site.name, p.name, a.point, a.rule, p.describe(a)) for p, a in selected]
    notes = [line for p in manager.order for line in p.notes([a for q, a in selected if q is p])]
    return Plan(list(program.sites.values()), rows, notes)
