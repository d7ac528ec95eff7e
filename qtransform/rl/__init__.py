"""Running transformed models in training loops: the noise controller (and, next, rollout
weights and phases). Sits above the passes: it drives the modules they insert."""

from qtransform.rl.noise import NoiseController, noise_controller

__all__ = ["NoiseController", "noise_controller"]
