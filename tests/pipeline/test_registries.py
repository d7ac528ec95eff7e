"""The registries check their entries when they load: a pass without its policy section or payload
type, a section without a valid example, a noise kind or noise module missing a part, a format
family without its ONNX half all fail at import with a message that says what to add."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qtransform.core.noise import NOISE_MODULES, NoiseModule
from qtransform.core.noise_kinds import NoiseKind, noise_kinds, register_noise_kind
from qtransform.pipeline import Action, Pass, register_pass
from qtransform.pipeline.base import _REGISTRY
from qtransform.schemas.sections import SECTIONS, Section, register_section
from tests.conftest import REPO


class _Spec:
    pass


def test_a_pass_must_read_a_registered_section_and_declare_its_payload():
    class NoSection(Pass[_Spec, dict]):
        name = tag = section = "no_such_section"

        def select(self, program, spec): return []
        def build(self, program, action): return torch.nn.Identity()

    with pytest.raises(ValueError) as info:
        register_pass(NoSection)
    assert str(info.value).startswith("pass 'no_such_section' reads the policy section 'no_such_section', which "
                                      "no module of qtransform/schemas/sections registers (sections: ")

    class Untyped(Pass):
        name, tag, section = "untyped", "untyped", "clamp"

        def select(self, program, spec): return []
        def build(self, program, action): return torch.nn.Identity()

    with pytest.raises(ValueError) as info:
        register_pass(Untyped)
    assert str(info.value) == ("pass 'untyped' must declare its payload type: class "
                               "Untyped(Pass[<SectionSpec>, <Payload>])")
    assert "no_such_section" not in _REGISTRY and "untyped" not in _REGISTRY


def test_the_manager_refuses_an_action_whose_payload_is_not_the_declared_type(tiny):
    import qtransform
    from qtransform.passes.clamp import Clamp

    class Loose(Pass[object, float]):
        name, tag, section = "loose", "loose", "clamp"

        def select(self, program, spec):
            return [Action(program.sites["model.layers.0.self_attn.k_proj"], "output", "x", {"limit": 1.0})]

        def build(self, program, action): return Clamp(action.payload)

    with pytest.raises(RuntimeError) as info:
        qtransform.transform(tiny("qwen2"), {"version": 1, "clamp": {"limit": 1.0}}, passes=[Loose()])
    assert str(info.value) == "pass 'loose' selected an action with a dict payload; it declares float"


def test_a_section_needs_a_valid_example():
    def words(_): return []

    with pytest.raises(ValueError) as info:
        register_section(Section("no_example", int | None, None, words, str, order=9))
    assert str(info.value) == ("policy section 'no_example' needs an example (Section(..., example=...)): "
                               "a minimal valid value")
    with pytest.raises(ValueError, match="policy section 'bad_example': its example is not valid"):
        register_section(Section("bad_example", int | None, None, words, str, order=9, example="x"))
    assert "no_example" not in SECTIONS and "bad_example" not in SECTIONS


def test_a_noise_kind_needs_every_part_and_a_known_draw():
    def add(x, z, s): return x + s * z

    with pytest.raises(TypeError) as info:
        NoiseKind("half", "x", add, add, None, draw="normal", neutral=0.0)
    assert str(info.value) == ("noise kind 'half' lacks onnx: a kind is its eager formula, its gradient "
                               "and its ONNX form together")
    with pytest.raises(ValueError, match="draw 'poisson' is not one of normal, uniform"):
        NoiseKind("odd", "x", add, add, add, draw="poisson", neutral=0.0)
    with pytest.raises(ValueError, match="noise kind 'add' is registered already"):
        register_noise_kind(NoiseKind("add", "x", add, add, add, draw="normal", neutral=0.0))
    assert [k.name for k in noise_kinds()][:2] == ["add", "relative"]


def test_a_noise_module_names_its_pass_and_defines_its_scale():
    with pytest.raises(TypeError) as info:
        class NoScale(NoiseModule):
            noise_pass = "no_scale"
    assert str(info.value) == ("NoScale: a NoiseModule names the pass that inserts it "
                               "(noise_pass = '<pass name>') and defines scale()")
    with pytest.raises(TypeError, match="pass 'hw_error' has a noise module already"):
        class Second(NoiseModule):
            noise_pass = "hw_error"

            def scale(self): return 1.0
    assert "no_scale" not in NOISE_MODULES and NOISE_MODULES["hw_error"].__name__ == "HWError"


def test_a_format_family_without_its_onnx_half_fails_when_export_loads():
    """(A family module is imported by `qtransform.formats` before the export loads; here the
    export's family package is loaded again after registering one, in a fresh process.)"""
    script = textwrap.dedent("""
        import importlib
        import qtransform.export.families
        from qtransform.formats.registry import Family, ROUNDINGS, register_family
        register_family(Family("orphan", {"rounding": ROUNDINGS}, quantize=None, scale_values=None))
        importlib.reload(qtransform.export.families)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: format families without an ONNX form: orphan; add qtransform/export/families/<family>.py "
        "registering an OnnxFamily and import it here")
