"""The other ways to write fake-quant into an exported graph: inlined bodies, and QDQ.

- inline: every `qtransform.<FORMAT>FakeQuant` call is replaced by its function body, for tools
  that do not read model-local functions. Same numbers as the function mode.
- qdq: QuantizeLinear/DequantizeLinear with FLOAT4E2M1 / FLOAT8 / INT4 / INT8 elements and E8M0
  or E4M3 scales (opset >= 24), the form deployment toolchains consume. Weights are stored
  quantized (codes and scales from `qtransform.formats.encode`, so their DequantizeLinear gives
  the reference values exactly); activations are quantized in the graph. onnx.checker and onnx's
  reference evaluator accept it; onnxruntime 1.31 answers NOT_IMPLEMENTED for these types.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import ModelProto, NodeProto, TensorProto, helper, numpy_helper

from qtransform import formats
from qtransform.errors import UserError
from qtransform.export.functions import (
    DOMAIN,
    Body,
    amax_or_inf,
    block_view,
    initializer,
    onnx_family,
)
from qtransform.export.graph import config_of, fake_quant_nodes, global_attrs
from qtransform.formats.blocking import from_blocks
from qtransform.formats.elements import decode_elements
from qtransform.formats.options import QuantConfig

# element name -> (ONNX element type, numpy dtype that onnx.numpy_helper writes as that type)
QDQ_ELEMENTS = {
    "e2m1": (TensorProto.FLOAT4E2M1, ml_dtypes.float4_e2m1fn),
    "e4m3": (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
    "e5m2": (TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2),
    "int4": (TensorProto.INT4, ml_dtypes.int4),
    "int8": (TensorProto.INT8, np.int8),
}


# -- inline -------------------------------------------------------------------------------------
def inline_functions(model: ModelProto) -> ModelProto:
    """Expand every qtransform function call into its body, named `<node name>/<value>`
    (in place: a model can be gigabytes).

    onnx.inliner does the same but leaves the expanded nodes unnamed; the names say which site
    each op belongs to.
    """
    bodies = {(f.domain, f.name, f.overload): f for f in model.functions}
    nodes: list[NodeProto] = []
    for node in model.graph.node:
        f = bodies.get((node.domain, node.op_type, node.overload))
        if f is None:
            nodes.append(node)
            continue
        rename = dict(zip(f.input, node.input, strict=True)) | dict(zip(f.output, node.output, strict=True))
        nodes.extend(Body(list(f.node)).embed(node.name, rename))
    types = _elem_types(model)
    for node in nodes:  # CastLike to a known type is a Cast, which onnxruntime constant-folds
        if node.op_type == "CastLike" and types.get(node.input[1]):
            to = types[node.input[1]]
            node.op_type = "Cast"
            del node.input[1:]
            node.attribute.append(helper.make_attribute("to", to))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_functions(model, lambda f: f.domain == DOMAIN)
    return model


def _elem_types(model: ModelProto) -> dict[str, int]:
    """Element type of every value whose type the exporter recorded."""
    types = {t.name: t.data_type for t in model.graph.initializer}
    for vi in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    return types


def _drop_functions(model: ModelProto, drop) -> None:
    keep = [f for f in model.functions if not drop(f)]
    del model.functions[:]
    model.functions.extend(keep)
    if not any(n.domain == DOMAIN for n in model.graph.node):
        keep_ops = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep_ops)


# -- qdq ------------------------------------------------------------------------------------------
def qdq_problem(cfg: QuantConfig) -> str | None:
    """Why a fake-quant config has no QDQ form, or None."""
    family = onnx_family(cfg)
    if family.weight_scale is None or family.activation_scale is None:
        return f"the {cfg.family.name} family has no QDQ form"
    if cfg.spec.element.name not in QDQ_ELEMENTS:
        return f"{cfg.spec.element.name} elements have no ONNX tensor type"
    if cfg.tile:
        return "2D tiles (block_shape) have no blocked QuantizeLinear form"
    if cfg.granularity != "block":
        return f"granularity {cfg.granularity!r}: the QDQ form covers 1D blocks only"
    if (cfg.int_range, cfg.scale_dtype) != ("restricted", "float32"):
        return (f"int_range {cfg.int_range!r} / scale_dtype {cfg.scale_dtype!r}: the QDQ form "
                "covers the restricted range with fp32 scales only")
    if cfg.rounding != "rne":
        return f"rounding {cfg.rounding!r}: QuantizeLinear rounds half to even only"
    return None


def _check(nodes: list[NodeProto]) -> None:
    problems = [(n.name, cfg.spec.name, why) for n in nodes
                if (why := qdq_problem(cfg := config_of(n)[0])) is not None]
    if problems:
        fmts = sorted({fmt for _, fmt, _ in problems})
        listed = "; ".join(f"{label} ({fmt}: {why})" for label, fmt, why in problems[:5])
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise UserError(
            f"fake_quant='qdq' has no QuantizeLinear/DequantizeLinear mapping for {', '.join(fmts)}: "
            f"{listed}{more}. QDQ covers mxfp4, mxfp8_e4m3, mxfp8_e5m2, nvfp4, int4 and int8 with "
            "rne rounding and 1D blocks; export the others with fake_quant='function'"
        )


def _weight_qdq(node: NodeProto, init: TensorProto, cfg: QuantConfig) -> tuple[list, list]:
    """Stored codes and scales, and the DequantizeLinear nodes that rebuild the weight."""
    label, elem = node.name, cfg.spec.element
    w = torch.from_numpy(numpy_helper.to_array(init).astype(np.float32))
    enc = formats.encode(w, cfg)
    values = from_blocks(decode_elements(enc.codes, elem), enc.layout).reshape(enc.shape)
    np_type = QDQ_ELEMENTS[elem.name][1]
    q = initializer(f"{label}/q", values.numpy().astype(np_type))
    grid = enc.scale_grid().reshape(enc.layout.grid_shape)
    block = {"axis": cfg.block_axis, "block_size": cfg.block, "output_dtype": TensorProto.FLOAT}
    weight_scale = onnx_family(cfg).weight_scale
    assert weight_scale is not None  # qdq_problem checked it
    inits, nodes = weight_scale(label, grid, enc.tensor_scale, cfg)
    inits.insert(0, q)
    out = node.output[0] if init.data_type == TensorProto.FLOAT else f"{label}/dequantized"
    nodes.append(helper.make_node("DequantizeLinear", [q.name, f"{label}/scale"], [out],
                                  name=f"{label}/dequantize", **block))
    if out != node.output[0]:
        nodes.append(helper.make_node("Cast", [out], [node.output[0]], name=f"{label}/cast", to=init.data_type))
    return inits, nodes


def _activation_scale(b: Body, xb: str, axes: str, cfg: QuantConfig) -> str:
    """Per-block scale for QuantizeLinear on activations: the family's rule (as in its function
    body); blocks with NaN/Inf get a NaN scale."""
    amax = amax_or_inf(b, xb, axes)
    activation_scale = onnx_family(cfg).activation_scale
    assert activation_scale is not None  # qdq_problem checked it
    scale = activation_scale(b, amax, cfg)
    return b.op("Where", b.op("IsInf", amax), b.const(np.nan), scale)


def _activation_qdq(node: NodeProto, cfg: QuantConfig) -> list[NodeProto]:
    """Scales computed from the activation in the graph, then QuantizeLinear/DequantizeLinear."""
    b = Body()
    view = block_view(b, b.op("Cast", "X", to=TensorProto.FLOAT), cfg)
    scale = view.grid(_activation_scale(b, view.xb, view.axes, cfg))
    scale_type = onnx_family(cfg).activation_scale_type
    if scale_type is not None:
        scale = b.op("Cast", scale, to=scale_type)
    elem_type = QDQ_ELEMENTS[cfg.spec.element.name][0]
    block = {"axis": cfg.block_axis, "block_size": cfg.block}
    x32 = b.nodes[0].output[0]
    q = b.op("QuantizeLinear", x32, scale, output_dtype=elem_type, **block)
    y = b.op("DequantizeLinear", q, scale, output_dtype=TensorProto.FLOAT, **block)
    b.nodes.append(helper.make_node("CastLike", [y, "X"], ["Y"]))
    return b.embed(node.name, {"X": node.input[0], "Y": node.output[0]})


def to_qdq(model: ModelProto) -> ModelProto:
    """Replace every fake-quant node by QuantizeLinear/DequantizeLinear (see module docstring),
    in place."""
    targets = fake_quant_nodes(model)
    _check(targets)
    ids = {id(n) for n in targets}
    inits = {t.name: t for t in model.graph.initializer}
    uses: dict[str, int] = {}
    for n in model.graph.node:
        for v in n.input:
            uses[v] = uses.get(v, 0) + 1
    nodes, new_inits, dropped = [], [], set()
    for node in model.graph.node:
        if id(node) not in ids:
            nodes.append(node)
            continue
        cfg, _ = config_of(node, model)
        if global_attrs(node):
            raise UserError(f"{node.name}: a static, shared or per-token global scale has no QDQ "
                            "form; export with --fake-quant function or inline")
        src = node.input[0]
        if src in inits:
            i, n = _weight_qdq(node, inits[src], cfg)
            new_inits += i
            nodes += n
            if uses[src] == 1:
                dropped.add(src)
        else:
            nodes += _activation_qdq(node, cfg)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    keep = [t for t in model.graph.initializer if t.name not in dropped]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep + new_inits)
    names = {formats.get(n).onnx_op for n in formats.names()}
    _drop_functions(model, lambda f: f.domain == DOMAIN and f.name in names)
    return model
