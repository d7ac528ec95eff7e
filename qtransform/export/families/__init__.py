"""The ONNX form of each format family (function body and QDQ form), one module per family of
`qtransform.formats`, registered under the same family name when `qtransform.export` loads."""

# isort: off
from qtransform.export.families import mx, nvfp4, intgroup  # noqa: F401
# isort: on
