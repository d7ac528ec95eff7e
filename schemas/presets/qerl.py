"""QeRL (NVlabs/QeRL): an NVFP4A16 base from llm-compressor plus AQN on the norms in rollouts.

The noise is QeRL's defaults (`trl_trainer/noise_scheduler.py`): Gaussian noise on the weights of
every RMSNorm, an exponential schedule from 1e-2 to 1e-4 in 10 stages whose first stage is
noise-free, a new draw per step, in the rollout phase only (docs/rl.md). The run's length is the
user's: a policy gives ``"noise": {"schedule": {"total_steps": N}}``.
"""

from __future__ import annotations

import copy

from . import Preset, register_preset
from .llm_compressor import NVFP4A16

QERL = register_preset(Preset(
    name="qerl",
    reproduces="QeRL's rollout model: llm-compressor's NVFP4A16 weights and adaptive quantization "
               "noise (AQN) on the RMSNorm weights during rollouts, QeRL's default schedule",
    checked_against="",
    content={
        "quantize": copy.deepcopy(list(NVFP4A16.content["quantize"])),
        "noise": {
            "targets": ["RMSNorm"],
            "schedule": {"kind": "exponential", "sigma_start": 1e-2, "sigma_end": 1e-4,
                         "num_stages": 10},
            "resample": "step",
            "apply_during": "rollout",
            "sigma_scale": "absolute",
        },
    },
))
