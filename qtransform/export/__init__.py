"""ONNX export of transformed models: `export_onnx` (onnx.py) with the fake-quant function bodies
(functions.py, and per format family in families/), post-processing and audit of the proto
(graph.py) and the other encodings (modes.py)."""

from qtransform.export import families  # noqa: F401  (registers each family's ONNX form)
from qtransform.export.onnx import ExportError, export_onnx

__all__ = ["ExportError", "export_onnx"]
