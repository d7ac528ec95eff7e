"""A policy in plain words: what each section will do, before anything runs; and every setting
of it (defaults filled in) with its field's description, the text the JSON Schema carries."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .policy import Policy
from .presets import describe as describe_preset
from .sections import ordered


def _present(value: object) -> bool:
    return value is not None and value != []


def explain(policy: Policy) -> str:
    """Every section of the policy in plain language, one paragraph each."""
    lines = [line for s in ordered() if _present(v := policy.section(s.name)) for line in s.describe(v)]
    if policy.preset is not None:
        lines.insert(0, describe_preset(policy.preset, policy.preset_options))
    return "\n".join(lines) if lines else "The policy is empty: it changes nothing."


def summary(policy: Policy) -> str:
    """One line: which sections are present, for `policy validate`."""
    parts = [s.summary(v) for s in ordered() if _present(v := policy.section(s.name))]
    head = f"preset {policy.preset}: " if policy.preset is not None else ""
    return head + (", ".join(parts) if parts else "empty policy")


def fields(policy: Policy) -> str:
    """Every setting of the policy's sections, defaults filled in, each with its description."""
    lines = []
    for section in ordered():
        value = policy.section(section.name)
        if not _present(value):
            continue
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            lines.append(f"{section.name}{'' if i is None else f'[{i}]'}: {section.description}")
            lines += _settings(item, "  ")
    return "\n".join(lines) if lines else "The policy is empty: it changes nothing."


def _settings(model: BaseModel, indent: str) -> list[str]:
    out = []
    for name, info in type(model).model_fields.items():
        value: Any = getattr(model, name)
        nested = value if isinstance(value, list) else [value]
        if nested and all(isinstance(v, BaseModel) for v in nested):
            out.append(f"{indent}{name}: {info.description}")
            for j, item in enumerate(nested):
                if isinstance(value, list):
                    out.append(f"{indent}  [{j}]")
                out += _settings(item, indent + ("    " if isinstance(value, list) else "  "))
        else:
            text = json.dumps(type(model).__pydantic_serializer__.to_python(model, mode="json")[name])
            out.append(f"{indent}{name} = {text}: {info.description}")
    return out
