"""The ONNX form of a rotation: one named `qtransform.Rotate` node per rotate insertion.

torch.onnx writes an opaque node for each `qtransform::rotate` op (inputs X and the operand R:
the Hadamard signs [b] or the matrix [b, b], an initializer); this module names it after its
label (`<site>/<point>_rotate`), attaches a model-local function per (kind, block) written with
standard ops, and checks the nodes against the transformation log. The Hadamard body repeats the
eager butterfly op for op (`core/rotation.py`: signs, the (a + c, a − c) stages, the 1/√b
multiplication, all fp32), so onnxruntime matches PyTorch bit for bit; a matrix is one MatMul
per block (equal to fp32 rounding: the summation order is the runtime's).
"""

from __future__ import annotations

from collections import Counter

from onnx import FunctionProto, ModelProto, NodeProto, TensorProto, helper

from qtransform.core.rotation import hadamard_scale
from qtransform.export.functions import DOMAIN, Body, ExportError
from qtransform.passes import RotatePass

OP_TYPE = "Rotate"


def rotate_nodes(model: ModelProto) -> list[NodeProto]:
    """The rotation nodes of a model's main graph."""
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def rotation_body(kind: str, block: int) -> Body:
    """Y = X rotated along its last axis per block of `block` (inputs X, R)."""
    b = Body()
    shape = b.op("Shape", "X")
    v = b.op("Reshape", b.op("Cast", "X", to=TensorProto.FLOAT), b.ints(-1, block))
    r = b.op("Cast", "R", to=TensorProto.FLOAT)
    if kind == "matrix":
        v = b.op("MatMul", v, r)
    else:
        if kind == "random_hadamard":
            v = b.op("Mul", v, r)
        h = 1
        while h < block:
            pairs = b.op("Reshape", v, b.ints(-1, block // (2 * h), 2, h))
            lo = b.op("Slice", pairs, b.ints(0), b.ints(1), b.ints(2))
            hi = b.op("Slice", pairs, b.ints(1), b.ints(2), b.ints(2))
            both = b.op("Concat", b.op("Add", lo, hi), b.op("Sub", lo, hi), axis=2)
            v = b.op("Reshape", both, b.ints(-1, block))
            h *= 2
        v = b.op("Mul", v, b.const(hadamard_scale(block)))
    b.nodes.append(helper.make_node("CastLike", [b.op("Reshape", v, shape), "X"], ["Y"]))
    return b


def _block(node: NodeProto, model: ModelProto) -> int:
    """The block size: the first dim of the operand initializer R."""
    for init in model.graph.initializer:
        if init.name == node.input[1]:
            return int(init.dims[0])
    raise ExportError(f"{node.name or node.output[0]}: the rotation operand {node.input[1]!r} is not "
                      "a constant of the graph")


def finish_rotations(model: ModelProto, opset: int, log: list[dict]) -> list[str]:
    """Name each rotation node after its label, give it its function and audit the log."""
    functions: dict[str, FunctionProto] = {}
    labels = []
    for node in rotate_nodes(model):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        label, kind = attrs["label"].decode(), attrs["kind"].decode()
        block = _block(node, model)
        node.name, node.overload = label, f"{kind}_{block}"
        del node.attribute[:]
        node.attribute.extend([helper.make_attribute("kind", kind)])
        if node.overload not in functions:
            functions[node.overload] = helper.make_function(
                DOMAIN, OP_TYPE, ["X", "R"], ["Y"], rotation_body(kind, block).nodes,
                [helper.make_opsetid("", opset)], attributes=["kind"], overload=node.overload)
        labels.append(label)
    model.functions.extend(functions.values())
    expected = Counter(RotatePass.label(e["site"], e["point"]) for e in log if e["pass_name"] == RotatePass.name)
    if Counter(labels) != expected:
        missing = sorted((expected - Counter(labels)).elements())
        raise ExportError(f"audit failed: the transformation log has {sum(expected.values())} rotations, "
                          f"the exported graph {len(labels)} rotation nodes"
                          + (f"; missing (folded or dropped): {', '.join(missing[:5])}" if missing else ""))
    return labels
