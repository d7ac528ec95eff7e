"""A policy in plain words: what each section will do, before anything runs."""

from __future__ import annotations

from .policy import Policy
from .sections import ordered


def _present(value: object) -> bool:
    return value is not None and value != []


def explain(policy: Policy) -> str:
    """Every section of the policy in plain language, one paragraph each."""
    lines = [line for s in ordered() if _present(v := policy.section(s.name)) for line in s.describe(v)]
    return "\n".join(lines) if lines else "The policy is empty: it changes nothing."


def summary(policy: Policy) -> str:
    """One line: which sections are present, for `policy validate`."""
    parts = [s.summary(v) for s in ordered() if _present(v := policy.section(s.name))]
    return ", ".join(parts) if parts else "empty policy"
