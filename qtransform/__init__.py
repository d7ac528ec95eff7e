"""qtransform: fake quantization, instrumentation and noise for LLMs, as passes on torch.fx.

The public API. Transform: `transform`, `transform_program`, `plan`, `capture`, `noise_controller`,
`save_transformed` / `load_transformed`. RL: `rollout_weights`, `rollout_filter`, `rollout`, `evaluation`. Numerics: `fake_quantize`, `formats`. Policies:
`Policy`, `load_policy`; presets named after the stacks: `preset_names`, `register_preset`,
`Preset` (docs/recipes.md). Scans: `scan_weights`, `compare_formats`, `scan_activations`,
`gain_scan`, `kurtosis_scan`, `instability_scan`, `ScanReport`, `guide`. Runs side by side:
`compare_runs`, `report_runs`. Export: `export_onnx`; deployable checkpoints
(compressed-tensors, ModelOpt): `export_checkpoint`. Pages: `Page`, `scan_page`,
`write_scan_page` (one self-contained HTML page per result). Checkpoints: `load_model` (also
opens compressed-tensors and ModelOpt folders), `checkpoint_policy`, `engine_differences`; weights already on a grid:
`grid_fit`, `GridFit`.

This façade is the top of the layers (docs/architecture.md): it imports every stage, which also
registers the passes of `qtransform.passes` with the pipeline.
"""

from qtransform import formats, passes
from qtransform.calibration import calibrate
from qtransform.core.capture import CaptureError, capture
from qtransform.core.program import Program, insertion_log
from qtransform.core.sites import Site
from qtransform.errors import UserError
from qtransform.export import export_onnx
from qtransform.export.checkpoint import export_checkpoint
from qtransform.formats import fake_quantize
from qtransform.models import checkpoint_policy, engine_differences, load_model
from qtransform.pipeline import Pass, PassManager, Plan, plan, transform, transform_program
from qtransform.pipeline.saving import load_transformed, save_transformed
from qtransform.report import Page, scan_page, write_scan_page
from qtransform.report.runs import report_runs
from qtransform.rl import (
    Correction,
    NoiseController,
    evaluation,
    log_to,
    mismatch_metrics,
    noise_controller,
    rollout,
    rollout_filter,
    rollout_weights,
)
from qtransform.scan import (
    ScanReport,
    compare_formats,
    gain_scan,
    guide,
    instability_scan,
    kurtosis_scan,
    scan_activations,
    scan_weights,
)
from qtransform.scan.grid import GridFit, grid_fit
from qtransform.scan.runs import compare_runs
from qtransform.schemas import Policy, load_policy
from qtransform.schemas.presets import Preset, preset_names, register_preset

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "calibrate",
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
    "insertion_log",
    "instability_scan",
    "kurtosis_scan",
    "load_policy",
    "load_transformed",
    "noise_controller",
    "passes",
    "plan",
    "rollout",
    "rollout_filter",
    "rollout_weights",
    "save_transformed",
    "scan_activations",
    "scan_weights",
    "transform",
    "transform_program",
    "evaluation",
]
__all__ += ["Correction", "log_to", "mismatch_metrics"]
__all__ += ["compare_runs", "report_runs"]
__all__ += ["Page", "scan_page", "write_scan_page"]
__all__ += ["Preset", "preset_names", "register_preset"]
__all__ += ["load_model", "checkpoint_policy", "engine_differences", "grid_fit", "GridFit"]
__all__ += ["export_checkpoint"]
