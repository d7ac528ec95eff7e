"""The pipeline layer: the pass contract and registry, the pass manager, selection, `transform()`
and `plan()`, saving and loading transformed models. It imports no pass: passes register
themselves (`register_pass`) when `qtransform.passes` is imported, which `import qtransform` does."""

from qtransform.core.plan import Plan, PlanRow
from qtransform.pipeline.base import Action, Pass, register_pass, registered_passes
from qtransform.pipeline.manager import PassManager
from qtransform.pipeline.transform import plan, transform, transform_program

__all__ = ["Action", "Pass", "PassManager", "Plan", "PlanRow", "plan", "register_pass",
           "registered_passes", "transform", "transform_program"]
