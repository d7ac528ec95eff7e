"""Editing an exported graph: qtransform's opaque nodes become named, runnable, audited nodes.

After torch.onnx has written one opaque `qtransform.*` node per custom op, this module renames
each after its label, attaches function bodies (fake-quant from qtransform.export.functions, noise
here), turns taps into graph outputs `tap:<site>:<point>` and noise draws into graph inputs
`noise:<site>/<point>` (or seeded draws, or nothing), and checks the fake-quant nodes against the
transformation log.
"""

from __future__ import annotations

import copy
import zlib
from collections import Counter
from typing import Any

import onnx
from onnx import FunctionProto, ModelProto, NodeProto, TensorProto, helper

from qtransform import formats
from qtransform.core.noise_kinds import DRAWS, noise_kind
from qtransform.core.ops import split_expert_label
from qtransform.export.functions import (
    DOMAIN,
    GLOBAL_ATTRS,
    Body,
    ExportError,
    Shape,
    UnsupportedExport,
    attributes,
    fake_quant_function,
    overload,
)
from qtransform.formats.options import QuantConfig
from qtransform.passes import FakeQuantPass


# -- reading nodes --------------------------------------------------------------------------------
def fake_quant_nodes(model: ModelProto) -> list[NodeProto]:
    """The opaque fake-quant nodes of a model's main graph."""
    ops = {formats.get(n).onnx_op for n in formats.names()}
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type in ops]


def config_of(node: NodeProto, model: ModelProto | None = None) -> tuple[QuantConfig, Shape]:
    """The numerics of an opaque fake-quant node, from its op_type and attributes, and (given
    the model) its input's static dims."""
    by_op = {formats.get(n).onnx_op: n for n in formats.names()}
    opts = {a.name: helper.get_attribute_value(a) for a in node.attribute
            if a.name != "label" and a.name not in GLOBAL_ATTRS}
    opts = {k: v.decode() if isinstance(v, bytes) else v for k, v in opts.items()}
    cfg = QuantConfig.from_options(by_op[node.op_type], opts)  # validated as fake_quantize does
    return cfg, None if model is None else static_dims(model, node.input[0])


def global_attrs(node: NodeProto) -> dict[str, Any]:
    """A fake-quant node's tensor-level amax attributes (`functions.GLOBAL_ATTRS`), if any."""
    out = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in GLOBAL_ATTRS}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in out.items()}


def static_dims(model: ModelProto, name: str) -> tuple[int | None, ...] | None:
    """A value's dims as the exporter recorded them (None for symbolic ones), if known."""
    for t in model.graph.initializer:
        if t.name == name:
            return tuple(t.dims)
    for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output):
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return tuple(d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim)
    return None


def _attrs(node: NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value: object) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    return list(value) if isinstance(value, list) else value


def _set_attrs(node: NodeProto, attrs: dict[str, Any]) -> None:
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())


def rename_value(model: ModelProto, old: str, new: str) -> None:
    """Rename a value wherever the main graph mentions it."""
    for node in model.graph.node:
        node.input[:] = [new if v == old else v for v in node.input]
        node.output[:] = [new if v == old else v for v in node.output]
    for vi in (*model.graph.output, *model.graph.value_info):
        if vi.name == old:
            vi.name = new


def _value_info(model: ModelProto, name: str) -> onnx.ValueInfoProto:
    for vi in (*model.graph.value_info, *model.graph.output, *model.graph.input):
        if vi.name == name:
            return copy.deepcopy(vi)
    return helper.make_empty_tensor_value_info(name)


def finish_taps(model: ModelProto, keep: bool) -> None:
    """Tap -> Identity named after its label, whose output `tap:<label>` is a graph output;
    without taps the node is bypassed."""
    seen: set[str] = set()
    for node in list(model.graph.node):
        if node.domain != DOMAIN or node.op_type != "Tap":
            continue
        label = _decode(_attrs(node)["label"])
        if label in seen:
            raise ExportError(f"tap {label!r} runs more than once per forward (a shared module); "
                              "its values cannot have one output name")
        seen.add(label)
        if not keep:
            _bypass(model, node)
            continue
        out = f"tap:{label}"
        rename_value(model, node.output[0], out)
        node.op_type, node.domain, node.name = "Identity", "", label
        _set_attrs(node, {})
        vi = _value_info(model, out)
        vi.name = out
        model.graph.output.append(vi)


def _bypass(model: ModelProto, node: NodeProto) -> None:
    """Remove a one-input identity-like node, rewiring its consumers to its input."""
    if node.output[0] in {o.name for o in model.graph.output}:
        node.op_type, node.domain = "Identity", ""
        del node.input[1:]
        _set_attrs(node, {})
        return
    model.graph.node.remove(node)
    src, dst = node.input[0], node.output[0]
    for other in model.graph.node:
        other.input[:] = [src if v == dst else v for v in other.input]


def finish_noise(model: ModelProto, mode: str, noise_inputs: list[str], opset: int) -> None:
    """Noise nodes get their kind's function; their draws stay graph inputs (documented with the
    kind's formula and neutral draw), become seeded draws of the kind's distribution (`random`)
    or disappear with the node (`off`)."""
    functions: dict[str, onnx.FunctionProto] = {}
    nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "Noise"]
    lost = [name for name in noise_inputs if name not in {n.input[1] for n in nodes}]
    if lost:
        raise ExportError(f"audit failed: {len(lost)} of {len(noise_inputs)} noise insertions have no noise "
                          f"node in the exported graph (folded or dropped): {', '.join(lost[:5])}")
    for node in nodes:
        attrs = {k: _decode(v) for k, v in _attrs(node).items()}
        label = attrs.pop("label")
        node.name = label
        if mode == "off":
            _bypass(model, node)
            continue
        if mode == "random":
            seed = float(zlib.crc32(label.encode()) % 2**24)
            z = f"{label}/z"
            model.graph.node.insert(list(model.graph.node).index(node), helper.make_node(
                RANDOM_OPS[noise_kind(attrs["kind"]).draw], [node.input[0]], [z], name=f"{label}/draw",
                dtype=onnx.TensorProto.FLOAT, seed=seed))
            node.input[1] = z
        overload = f"{attrs['kind']}_{attrs['scale']!r}".replace(".", "p").replace("-", "m")
        node.overload = overload
        _set_attrs(node, attrs)
        functions.setdefault(overload, noise_function(attrs["kind"], attrs["scale"], opset, overload))
    if mode == "input":
        _noise_dims_like_x(model)
        _document_draws(model)
    else:
        keep = [i for i in model.graph.input if i.name not in set(noise_inputs)]
        del model.graph.input[:]
        model.graph.input.extend(keep)
    model.functions.extend(functions.values())


def _document_draws(model: ModelProto) -> None:
    """Each draw input says what it feeds and which value switches the noise off."""
    inputs = {i.name: i for i in model.graph.input}
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == "Noise" and node.input[1] in inputs:
            kind = noise_kind(_decode(_attrs(node)["kind"]))
            off = (f"all {kind.neutral:g} disables it" if kind.neutral is not None
                   else "no draw disables it (export with noise='off')")
            inputs[node.input[1]].doc_string = (f"draw z ({kind.draw}, fp32) of {node.name}: {kind.name} noise "
                                                f"{kind.formula}; {off}")


def _noise_dims_like_x(model: ModelProto) -> None:
    """A draw has its noised value's shape: give the graph input that value's dims (batch,
    sequence, ...) instead of the exporter's unrelated symbols."""
    inputs = {i.name: i for i in model.graph.input}
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == "Noise" and node.input[1] in inputs:
            src = _value_info(model, node.input[0]).type.tensor_type
            dst = inputs[node.input[1]].type.tensor_type
            if src.HasField("shape") and len(src.shape.dim) == len(dst.shape.dim):
                dst.shape.CopyFrom(src.shape)


def finish_fake_quant(model: ModelProto, opset: int) -> list[str]:
    """Name each fake-quant node after its label and attach one function per overload."""
    labels, functions = [], {}
    for node in fake_quant_nodes(model):
        label = _decode(_attrs(node)["label"])
        cfg, shape = config_of(node, model)
        extra = global_attrs(node)
        node.name, node.overload = label, overload(cfg, shape, extra)
        _set_attrs(node, {**attributes(cfg), **extra})
        functions.setdefault((node.op_type, node.overload), fake_quant_function(cfg, opset, shape, extra))
        labels.append(label)
    model.functions.extend(functions.values())
    return labels


def audit(labels: list[str], log: list[dict]) -> None:
    """Every quantized site tensor of the log appears as exactly one fake-quant node (a fused
    experts weight quantized expert by expert: one node per expert, `<label>.expert<e>`; an
    attention tensor with one scale per head: one node per head, `<label>.head<h>`)."""
    expected = Counter(FakeQuantPass.label(e["site"], e["point"]) for e in log if e["pass_name"] == FakeQuantPass.name)
    found: Counter[str] = Counter()
    experts: dict[str, set[int]] = {}
    for label in labels:
        base, expert = split_expert_label(label)
        if expert is None:
            found[base] += 1
        elif expert in experts.setdefault(base, set()):
            found[label] += 1  # a duplicate expert node: reported as unexpected
        else:
            experts[base].add(expert)
    for base, seen in experts.items():
        found[base if seen == set(range(len(seen))) else f"{base} (experts {sorted(seen)})"] += 1
    if found != expected:
        missing = sorted((expected - found).elements())
        extra = sorted((found - expected).elements())
        raise ExportError(
            f"audit failed: the transformation log has {sum(expected.values())} fake-quant "
            f"insertions, the exported graph {sum(found.values())} fake-quant nodes"
            + (f"; missing (folded or dropped): {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected: {', '.join(extra[:5])}" if extra else "")
        )


def name_dims(model: ModelProto) -> None:
    """Readable names for the first input's dynamic dims (batch, sequence), everywhere."""
    if not model.graph.input:
        return
    dims = model.graph.input[0].type.tensor_type.shape.dim
    names = {d.dim_param: new for d, new in zip(dims, ("batch", "sequence"), strict=False) if d.dim_param}
    if not names:
        return
    for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in names:
                d.dim_param = names[d.dim_param]


# -- noise bodies ---------------------------------------------------------------------------------
RANDOM_OPS = {"normal": "RandomNormalLike", "uniform": "RandomUniformLike"}  # a kind's draw, in ONNX
if set(RANDOM_OPS) != set(DRAWS):
    raise ImportError(f"export/graph.py: RANDOM_OPS covers {sorted(RANDOM_OPS)}, noise kinds draw {sorted(DRAWS)}")


class NoiseBody(Body):
    """The `OnnxBuilder` a noise kind writes its form with (`core/noise_kinds.py`)."""

    def as_float(self, value: str) -> str:
        return self.op("Cast", value, to=TensorProto.FLOAT)

    def rounded(self, value: str) -> str:
        """`value` rounded to X's dtype and carried on in fp32: PyTorch's arithmetic in x.dtype."""
        return self.as_float(self.op("CastLike", value, "X"))


def noise_function(kind: str, scale: float, opset: int, overload: str) -> FunctionProto:
    """The registered kind's formula (`NoiseKind.onnx`), its result cast to X's dtype."""
    try:
        form = noise_kind(kind).onnx
    except ValueError as exc:
        raise UnsupportedExport(str(exc)) from None
    b = NoiseBody()
    out = form(b, scale)
    b.nodes.append(helper.make_node("CastLike", [out, "X"], ["Y"]))
    return helper.make_function(
        DOMAIN, "Noise", ["X", "Z"], ["Y"], b.nodes, [helper.make_opsetid("", opset)],
        attributes=["kind", "scale"], overload=overload,
    )
