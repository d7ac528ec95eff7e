"""The ONNX form of each format family (function body and QDQ form), one module per family of
`qtransform.formats`, registered under the same family name when `qtransform.export` loads.
Loading checks that every family registered so far has its form (a family added without its ONNX
half fails here, at import, rather than at its first export)."""

from qtransform.export.functions import onnx_family_names as _onnx_names
from qtransform.formats import families as _families

# isort: off
from qtransform.export.families import mx, nvfp4, intgroup, fp8  # noqa: F401
# isort: on

_missing = [f.name for f in _families() if f.name not in _onnx_names()]
if _missing:
    raise ImportError(f"format families without an ONNX form: {', '.join(_missing)}; add "
                      "qtransform/export/families/<family>.py registering an OnnxFamily and import it here")
