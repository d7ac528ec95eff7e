"""Deployable checkpoints of transformed models: `export_checkpoint` (export.py) writes the
compressed-tensors layout (compressed_tensors.py) or ModelOpt's (modelopt.py) from what the
model holds (collect.py), one tensor at a time (writer.py); docs/export.md."""

from qtransform.export.checkpoint.collect import Refused
from qtransform.export.checkpoint.export import FORMATS, export_checkpoint

__all__ = ["FORMATS", "Refused", "export_checkpoint"]
