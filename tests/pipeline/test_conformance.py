"""One conformance test that every registered pass inherits, at both graph granularities.

Parametrized over `registered_passes()`, so a new pass is covered without a line here; each pass
runs with its section's example (`Section.example`, validated when the section registers) on a
one-layer tiny Qwen2:

- the plan rows equal the insertion log (the manager's rows, `plan()` and the model's own log);
- without the pass (the policy without its section) the outputs are the original model's bit for
  bit, and switched off (noise: the controller's `disabled()`; fake-quant: `enabled`) too, while
  switched on they differ;
- `export_onnx` passes its audit, and every inserted module with a label is one named node;
- `save_transformed` / `load_transformed` give the same outputs bit for bit (module graphs only:
  a whole-model graph module has no `save_pretrained`).
"""

from __future__ import annotations

import onnx
import pytest
import torch

import qtransform
from qtransform.core.noise import noise_modules
from qtransform.core.program import insertion_log
from qtransform.errors import UserError
from qtransform.models import build_tiny
from qtransform.pipeline import registered_passes
from qtransform.schemas.sections import SECTIONS
from tests.conftest import ids

PASSES = [p.name for p in registered_passes()]
NOISY_STEP = 3  # a step where every example's noise is on (AQN's interval 0 is noise-free)


def policy_for(name: str) -> dict:
    section = next(p for p in registered_passes() if p.name == name).section
    return {"version": 1, section: SECTIONS[section].example}


def model() -> torch.nn.Module:
    return build_tiny("qwen2", num_layers=1).train()  # train: noise of every phase but rollout runs


def run(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=x, use_cache=False).logits


def at_noisy_step(module: torch.nn.Module) -> torch.nn.Module:
    if noise_modules(module):
        qtransform.noise_controller(module).set_step(NOISY_STEP)
    return module


def switched_off(module: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """The outputs with this pass's inserted modules switched off, where they have a switch."""
    inserted = [module.get_submodule(i.module_path) for i in insertion_log(module) if i.pass_name == name]
    if noise_modules(module):
        with qtransform.noise_controller(module).disabled():
            return run(module, x)
    if all(hasattr(m, "enabled") and hasattr(m, "quantize") for m in inserted):  # fake-quant
        for m in inserted:
            m.enabled = False
        try:
            return run(module, x)
        finally:
            for m in inserted:
                m.enabled = True
    return None


@pytest.fixture(scope="module")
def base():
    m = model()
    x = ids(2, 8)
    return m, x, run(m, x)


@pytest.mark.parametrize("mode", ["module", "graph"])
@pytest.mark.parametrize("name", PASSES)
def test_every_pass_conforms(name, mode, base, tmp_path):
    original, x, want = base
    pol = policy_for(name)
    example = {"input_ids": x} if mode == "graph" else None
    if mode not in next(p for p in registered_passes() if p.name == name).modes:
        with pytest.raises(UserError, match=f"works in .* mode only; drop mode='{mode}'"):
            qtransform.transform_program(original, pol, example, mode=mode)
        return
    program = qtransform.transform_program(original, pol, example, mode=mode)
    transformed = at_noisy_step(program.module())

    # plan rows == insertion log, from the manager, from plan() and from the model itself
    logged = [(i.site, i.pass_name, i.point) for i in program.log]
    assert logged and {p for _, p, _ in logged} == {name}
    assert [(r.site, r.pass_name, r.point) for r in program.plan_rows] == logged
    planned = qtransform.plan(original, pol, example).rows
    assert [(r.site, r.pass_name, r.point, r.rule, r.detail) for r in planned] == [
        (r.site, r.pass_name, r.point, r.rule, r.detail) for r in program.plan_rows]
    assert sorted((i.site, i.pass_name, i.point) for i in insertion_log(transformed)) == sorted(logged)

    # off: the policy without the pass, and the pass's own switch
    without = qtransform.transform(original, {"version": 1}, example, mode=mode)
    assert torch.equal(run(without, x), want)
    off = switched_off(transformed, name, x)
    if off is not None:  # a pass with a switch changes the outputs, so that "off" means something
        assert not torch.equal(run(transformed, x), want)
        assert torch.equal(off, want)

    # export: the audit passes and every labelled insertion is one named node
    path = qtransform.export_onnx(program, tmp_path / "m.onnx", {"input_ids": x})
    nodes = {n.name for n in onnx.load(path).graph.node}
    labels = [getattr(transformed.get_submodule(i.module_path), "label", None) for i in insertion_log(transformed)]
    assert [label for label in labels if label is not None and label not in nodes] == []

    # save / load: the same outputs bit for bit (module graphs)
    if mode == "module":
        fresh = at_noisy_step(qtransform.transform(original, pol))
        qtransform.save_transformed(fresh, pol, tmp_path / "saved")
        loaded = at_noisy_step(qtransform.load_transformed(tmp_path / "saved").train())
        assert torch.equal(run(loaded, x), run(fresh, x))
        assert [(i.site, i.pass_name, i.point) for i in insertion_log(loaded)] == logged


def test_the_examples_cover_every_pass_and_reach_the_model():
    """Every registered pass reads a registered section (checked at import) whose example
    selects something on the tiny model (a dead example would make the test above vacuous)."""
    assert {p.section for p in registered_passes()} <= set(SECTIONS)
    m = build_tiny("qwen2", num_layers=1)
    for name in PASSES:
        assert qtransform.plan(m, policy_for(name)).rows, name
