"""qtransform: fake quantization, instrumentation and noise for LLMs, as passes on torch.fx."""

from qtransform import formats
from qtransform.capture import CaptureError, capture
from qtransform.errors import UserError
from qtransform.formats import fake_quantize
from qtransform.noise import NoiseController, noise_controller
from qtransform.pipeline import Pass, PassManager, Plan, plan, transform
from qtransform.program import Program
from qtransform.sites import Site

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "NoiseController",
    "Pass",
    "PassManager",
    "Plan",
    "Program",
    "Site",
    "UserError",
    "capture",
    "fake_quantize",
    "formats",
    "noise_controller",
    "plan",
    "transform",
]
from qtransform.saving import load_transformed, save_transformed  # noqa: E402

__all__ += ["load_transformed", "save_transformed"]
from qtransform.schemas import Policy, load_policy  # noqa: E402

__all__ += ["Policy", "load_policy"]
