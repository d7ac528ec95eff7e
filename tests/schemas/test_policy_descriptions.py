"""Every policy field explains itself: a description in the models, hence in the JSON Schema
(`qtransform policy schema`, editors' hover text) and in `policy explain --fields`."""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from qtransform.schemas import Policy
from qtransform.schemas.generate import SCHEMA_PATH


def models(root: type[BaseModel]) -> list[type[BaseModel]]:
    """The policy root and every model reachable from its fields' annotations."""
    found: list[type[BaseModel]] = []

    def visit(tp: typing.Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp not in found:
                found.append(tp)
                for field in tp.model_fields.values():
                    visit(field.annotation)
            return
        for arg in typing.get_args(tp):
            visit(arg)

    visit(root)
    return found


def test_every_field_of_every_policy_model_has_a_description():
    reached = models(Policy)
    names = {m.__name__ for m in reached}
    assert {"QuantRule", "InstrumentSpec", "Thresholds", "NoiseSpec", "Schedule", "Multiplier",
            "HWErrorSpec", "ClampSpec"} <= names
    missing = [f"{m.__name__}.{name}" for m in reached for name, field in m.model_fields.items()
               if not (field.description or "").strip()]
    assert not missing, f"policy fields without a description: {missing}"


def test_the_committed_json_schema_describes_every_property():
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    owners = [("Policy", schema), *schema["$defs"].items()]
    props = [(owner, name, spec) for owner, d in owners for name, spec in d.get("properties", {}).items()]
    assert len(props) >= 60
    assert not [f"{o}.{n}" for o, n, spec in props if "description" not in spec]


def test_policy_explain_fields_lists_every_setting_with_its_description(capsys):
    from qtransform.cli.main import main
    from qtransform.schemas.sections.noise import NoiseSpec, Schedule
    from tests.conftest import REPO

    assert main(["policy", "explain", str(REPO / "schemas/examples/qerl_aqn.json"), "--fields"]) == 0
    out = capsys.readouterr().out
    settings = out.split("Settings:\n", 1)[1].splitlines()
    assert settings[0].startswith("quantize[0]: fake-quantize rules, in order")
    assert '  format = "nvfp4": a registered format, e.g. mxfp4, nvfp4, int4' in settings
    assert "  schedule: sigma over training" in settings
    assert "    warmup_steps = 0: noise-free steps before the first interval" in settings
    for model, indent in ((NoiseSpec, "  "), (Schedule, "    ")):
        for name, field in model.model_fields.items():
            assert any(line.startswith(f"{indent}{name}") and line.endswith(field.description)
                       for line in settings), name
