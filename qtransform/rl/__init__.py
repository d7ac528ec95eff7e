"""Running transformed models in RL loops: the noise controller, rollout weights, the rollout
phase. Sits above the passes: it drives the modules they insert."""

from qtransform.core.phase import rollout
from qtransform.rl.correction import Correction, icepop_mask, importance_weights, rejection_mask
from qtransform.rl.mismatch import mismatch_metrics
from qtransform.rl.noise import NoiseController, evaluation, noise_controller, silent_reason
from qtransform.rl.parity import HFEngine, parity
from qtransform.rl.parity_report import ParityReport
from qtransform.rl.sampling import Sampling
from qtransform.rl.simulated import simulated_engine
from qtransform.rl.tracking import log_to, rl_metrics, weight_stats
from qtransform.rl.weights import rollout_filter, rollout_weights

__all__ = ["HFEngine", "NoiseController", "ParityReport", "noise_controller", "parity", "rollout",
           "rollout_filter", "rollout_weights", "silent_reason", "evaluation"]
__all__ += ["Correction", "icepop_mask", "importance_weights", "log_to", "mismatch_metrics",
            "rejection_mask", "rl_metrics", "weight_stats"]
__all__ += ["Sampling", "simulated_engine"]
