"""qtransform: fake quantization, instrumentation and noise for LLMs, as passes on torch.fx.

The public API. Transform: `transform`, `plan`, `capture`, `noise_controller`,
`save_transformed` / `load_transformed`. Numerics: `fake_quantize`, `formats`. Policies:
`Policy`, `load_policy`. Scans: `scan_weights`, `compare_formats`, `scan_activations`,
`gain_scan`, `kurtosis_scan`, `instability_scan`, `ScanReport`, `guide`. Export: `export_onnx`.
"""

from qtransform import formats
from qtransform.activation_scan import scan_activations
from qtransform.capture import CaptureError, capture
from qtransform.errors import UserError
from qtransform.fault_scan import gain_scan, instability_scan, kurtosis_scan
from qtransform.formats import fake_quantize
from qtransform.noise import NoiseController, noise_controller
from qtransform.onnx_export import export_onnx
from qtransform.pipeline import Pass, PassManager, Plan, plan, transform
from qtransform.program import Program
from qtransform.recommend import guide
from qtransform.report import ScanReport
from qtransform.saving import load_transformed, save_transformed
from qtransform.scan import compare_formats, scan_weights
from qtransform.schemas import Policy, load_policy
from qtransform.sites import Site

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "NoiseController",
    "Pass",
    "PassManager",
    "Plan",
    "Policy",
    "Program",
    "ScanReport",
    "Site",
    "UserError",
    "capture",
    "compare_formats",
    "export_onnx",
    "fake_quantize",
    "formats",
    "gain_scan",
    "guide",
    "instability_scan",
    "kurtosis_scan",
    "load_policy",
    "load_transformed",
    "noise_controller",
    "plan",
    "save_transformed",
    "scan_activations",
    "scan_weights",
    "transform",
]
