"""Converting pre-policy SRDD sigma configs into a Policy.

The seed experiments stored SRDD-guided AQN as ``{"base_sigma": 0.01, "layer_multipliers":
{"14": 1.5, ...}}``, sometimes with the noise_injection settings next to it (sigma_start,
sigma_end, num_stages, stages_per_epoch, layer_types, exclude_patterns). Conversion is explicit
(`load_policy` refuses such files) because it has to fill in what the old files never said: the
training length and, when missing, sigma_end.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from qtransform.formats.registry import suggest

from .errors import PolicyError, Problem
from .loading import read_json, validate_policy
from .policy import Policy

SCHEDULE_KEYS = (
    "sigma_end",
    "num_stages",
    "total_steps",
    "steps_per_epoch",
    "stages_per_epoch",
    "epochs",
    "warmup_steps",
)
LEGACY_KEYS = (
    "base_sigma",
    "sigma_start",
    "layer_multipliers",
    "layer_types",
    "exclude_patterns",
    "seed",
    *SCHEDULE_KEYS,
)
LAYER_TYPES = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm", "linear": "Linear"}
# QeRL decays sigma by two decades (1e-2 -> 1e-4); used when a legacy file has no sigma_end.
DEFAULT_END_RATIO = 1e-2


def from_legacy_srdd(
    cfg: Mapping[str, Any] | str | os.PathLike,
    *,
    total_steps: int | None = None,
    sigma_end: float | None = None,
    num_stages: int | None = None,
) -> Policy:
    """A noise-only Policy from a legacy SRDD sigma config (dict, path or JSON text).

    Keyword arguments fill values the file lacks (a value in the file wins). Without any
    sigma_end, the QeRL ratio sigma_end = sigma_start / 100 is used.
    """
    data, source = read_json(cfg)
    if not isinstance(data, dict):
        raise PolicyError([Problem("(legacy config)", "expected a JSON object", data)], source)
    problems = [
        Problem(
            str(key), "unknown legacy key", allowed=LEGACY_KEYS, hint=suggest(str(key), LEGACY_KEYS)
        )
        for key in data
        if key not in LEGACY_KEYS
    ]
    if "base_sigma" in data and "sigma_start" in data and data["base_sigma"] != data["sigma_start"]:
        problems.append(
            Problem("sigma_start", "disagrees with base_sigma; keep one", data["sigma_start"])
        )
    start = data.get("base_sigma", data.get("sigma_start"))
    if start is None:
        problems.append(Problem("base_sigma", "required field is missing"))
    schedule = {k: data[k] for k in SCHEDULE_KEYS if k in data}
    for key, value in (
        ("total_steps", total_steps),
        ("sigma_end", sigma_end),
        ("num_stages", num_stages),
    ):
        if value is not None and key not in schedule:
            schedule[key] = value
    if not any(k in schedule for k in ("total_steps", "steps_per_epoch", "stages_per_epoch")):
        problems.append(
            Problem(
                "total_steps",
                "the legacy config gives no training length; pass "
                "total_steps=N (CLI: --total-steps N)",
            )
        )
    if (
        isinstance(start, (int, float))
        and not isinstance(start, bool)
        and "sigma_end" not in schedule
    ):
        schedule["sigma_end"] = start * DEFAULT_END_RATIO
    noise: dict[str, Any] = {"schedule": {"kind": "exponential", "sigma_start": start, **schedule}}
    if "layer_multipliers" in data:
        noise["layer_multipliers"] = data["layer_multipliers"]
    if "exclude_patterns" in data:
        noise["ignore"] = data["exclude_patterns"]
    if "seed" in data:
        noise["seed"] = data["seed"]
    if "layer_types" in data:
        types = data["layer_types"]
        bad = (
            [t for t in types if str(t).lower() not in LAYER_TYPES]
            if isinstance(types, list)
            else [types]
        )
        if bad:
            problems += [
                Problem("layer_types", "unknown layer type", t, list(LAYER_TYPES)) for t in bad
            ]
        else:
            noise["targets"] = [LAYER_TYPES[str(t).lower()] for t in types]
    if problems:
        raise PolicyError(problems, source)
    return validate_policy(
        {"version": 1, "noise": noise}, f"{source or 'legacy config'} (converted)"
    )
