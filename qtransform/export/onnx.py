"""`export_onnx`: a transformed model as an instrumented ONNX file that plain onnxruntime runs.

torch.onnx (dynamo) exports the model with qtransform's custom ops translated to opaque nodes in
the `qtransform` domain. Opaque nodes are what keeps them: the exporter's optimiser would fold a
decomposed weight fake-quant into an anonymous initializer. Afterwards each node is renamed after
its label and given a model-local function body (qtransform.export.functions), taps become named
graph outputs and noise draws named graph inputs; an audit against the insertion log makes sure
no fake-quant was lost on the way.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnx
import torch
from onnx import ModelProto, helper
from torch import nn

import qtransform.core.ops  # noqa: F401 - registers the custom ops the translations refer to
from qtransform.core.capture import ExampleInputs, normalize_inputs, with_attention_mask
from qtransform.core.experts import traceable_experts
from qtransform.core.io import atomic_files
from qtransform.core.noise import NoiseModule
from qtransform.core.ops import op_config
from qtransform.core.program import Program, insertion_log
from qtransform.errors import UserError
from qtransform.export.functions import DOMAIN, ExportError, UnsupportedExport, attributes
from qtransform.export.graph import (
    audit,
    finish_fake_quant,
    finish_noise,
    finish_taps,
    name_dims,
    rename_value,
)
from qtransform.export.modes import inline_functions, to_qdq
from qtransform.export.rotation_onnx import finish_rotations
from qtransform.formats.options import CHOICE_OPTIONS
from qtransform.passes.fake_quant import FakeQuantize

FAKE_QUANT_MODES = ("function", "inline", "qdq")
NOISE_MODES = ("input", "random", "off")
DEFAULT_OPSET = 21  # float8 Casts need 19; 21 is widely supported (onnxruntime 1.31 runs 19-26)
QDQ_OPSET = 24  # E8M0 scales in QuantizeLinear/DequantizeLinear need opset 24
PROTO_LIMIT = 2**31 - 2**20  # protobuf's 2 GiB limit, less headroom for the graph itself


# -- translations: custom ops -> opaque qtransform nodes --------------------------------------
_SCHEMAS: dict[str, onnx.defs.OpSchema] = {}
_A = onnx.defs.OpSchema.AttrType
_OP_ATTRS = {  # every attribute an opaque node may carry, by op
    "fake_quant": {"axis": _A.INT, "block_size": _A.INT, "block_shape": _A.INTS, "label": _A.STRING,
                   "granularity": _A.STRING, "global_amax": _A.FLOAT, "global_scale": _A.STRING,
                   "tensor_scale": _A.FLOAT,
                   **dict.fromkeys(CHOICE_OPTIONS, _A.STRING)},
    "Tap": {"label": _A.STRING},
    "Noise": {"scale": _A.FLOAT, "kind": _A.STRING, "label": _A.STRING},
    "Rotate": {"kind": _A.STRING, "label": _A.STRING},
}


def _opaque(op_type: str, kind: str, inputs: list, attrs: dict[str, Any]):
    """Emit `qtransform.<op_type>` through the exporter's tracer, which wants an OpSchema."""
    import onnxscript  # 0.65 s to import: only when exporting

    if op_type not in _SCHEMAS:
        S = onnx.defs.OpSchema
        _SCHEMAS[op_type] = S(
            op_type, DOMAIN, 1,
            inputs=[S.FormalParameter(name, "T") for name in (("X", "R") if kind == "Rotate" else ("X", "Z"))[: len(inputs)]],
            outputs=[S.FormalParameter("Y", "T")],
            type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
            attributes=[S.Attribute(k, t, "", required=False) for k, t in _OP_ATTRS[kind].items()],
        )
    op = onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), op_type, _SCHEMAS[op_type])
    return op(*inputs, **attrs)


# onnxscript's names of the dtypes a fake-quant input may have -> qtransform's scale_dtype names
_DTYPE_NAMES = {"FLOAT": "float32", "DataType.FLOAT": "float32", "BFLOAT16": "bfloat16",
                "DataType.BFLOAT16": "bfloat16", "FLOAT16": "float16", "DataType.FLOAT16": "float16"}


def _fake_quant_translation(x, fmt: str, options: str, label: str):
    try:
        cfg, extra = op_config(fmt, options)
        if cfg.stochastic:
            raise UnsupportedExport("stochastic rounding cannot be exported (its draws are not reproducible)")
        dtype = _DTYPE_NAMES.get(str(getattr(x, "dtype", "")))
        if cfg.scale_dtype == "input" and dtype:  # the exported tensor's: fp32 exports float32
            cfg = replace(cfg, scale_dtype=dtype)
        if cfg.scale_dtype != "float32":
            raise UnsupportedExport(f"scale_dtype {cfg.scale_dtype!r} has no ONNX body; export "
                                    "the model in float32 or with scale_dtype 'float32'")
    except ValueError as exc:
        raise ExportError(f"fake-quant {label!r} ({fmt}): {exc}") from exc
    return _opaque(cfg.spec.onnx_op, "fake_quant", [x], {**attributes(cfg), **extra, "label": label})


def _tap_translation(x, label: str):
    return _opaque("Tap", "Tap", [x], {"label": label})


def _noise_translation(x, z, scale: float, kind: str, label: str):
    return _opaque("Noise", "Noise", [x, z], {"scale": float(scale), "kind": kind, "label": label})


def _rotate_translation(x, operand, kind: str, label: str):
    return _opaque("Rotate", "Rotate", [x, operand], {"kind": kind, "label": label})


def translation_table() -> dict[Callable, Callable]:
    return {
        torch.ops.qtransform.fake_quant.default: _fake_quant_translation,
        torch.ops.qtransform.tap.default: _tap_translation,
        torch.ops.qtransform.noise.default: _noise_translation,
        torch.ops.qtransform.rotate.default: _rotate_translation,
    }


# -- what is exported --------------------------------------------------------------------------
def _log_of(model_or_program: nn.Module | Program) -> tuple[nn.Module, nn.Module, list[dict]]:
    """(module to export, model whose forward signature names the inputs, insertion log)."""
    if isinstance(model_or_program, Program):
        log = [i.to_dict() for i in model_or_program.log]
        return model_or_program.module(), model_or_program.model, log
    log = [i.to_dict() for i in insertion_log(model_or_program)]
    if not log:
        raise UserError(
            "export_onnx needs a model returned by qtransform.transform (it carries the insertion "
            "log the export is audited against) or a Program"
        )
    return model_or_program, model_or_program, list(log)


def _noise_modules(module: nn.Module, log: list[dict]) -> list[tuple[str, str, nn.Module]]:
    """(graph input name `noise:<site>/<point>`, point, module) for every inserted noise module."""
    found = []
    for entry in log:
        try:
            mod = module.get_submodule(entry["module_path"])
        except AttributeError:
            continue
        if isinstance(mod, NoiseModule):
            found.append((entry, mod))
    counts = Counter((e["site"], e["point"]) for e, _ in found)
    named = []
    for e, mod in found:
        name = f"noise:{e['site']}/{e['point']}"
        named.append((name + (f"_{e['tag']}" if counts[(e["site"], e["point"])] > 1 else ""), e["point"], mod))
    return named


def _flatten_outputs(out: object) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    if isinstance(out, torch.Tensor):
        return ["output"], (out,)
    if isinstance(out, dict):  # ModelOutput is a dict
        items = [(k, v) for k, v in out.items() if isinstance(v, torch.Tensor)]
        return [k for k, _ in items], tuple(v for _, v in items)
    if isinstance(out, (tuple, list)):
        tensors = tuple(v for v in out if isinstance(v, torch.Tensor))
        return [f"output_{i}" for i in range(len(tensors))], tensors
    raise ExportError(f"the model returned {type(out).__name__}; export needs tensors")


class _Wrapper(nn.Module):
    """Flat tensors in, flat tensors out; noise draws enter as extra inputs via `noise_override`."""

    def __init__(self, model: nn.Module, n_args: int, kw_names: list[str], const_kwargs: dict,
                 noise: list[nn.Module]):
        super().__init__()
        self.model = model
        self.n_args, self.kw_names, self.const_kwargs = n_args, kw_names, const_kwargs
        self.noise = noise
        # A namespace, not a list: export restores list attributes it saw change while tracing.
        self.outputs = SimpleNamespace(names=[])

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = tensors[: self.n_args]
        kw_end = self.n_args + len(self.kw_names)
        kwargs = dict(zip(self.kw_names, tensors[self.n_args:kw_end], strict=True))
        for mod, z in zip(self.noise, tensors[kw_end:], strict=True):
            mod.noise_override = z
        try:
            out = self.model(*args, **kwargs, **self.const_kwargs)
        finally:
            for mod in self.noise:
                mod.noise_override = None
        self.outputs.names, flat = _flatten_outputs(out)
        return flat


def _noise_shapes(model: nn.Module, args: tuple, kwargs: dict, noise: list[nn.Module]) -> list[torch.Size]:
    """The shape each noise module sees, from one eager forward (its z has that shape)."""
    if not noise:
        return []
    shapes: dict[int, torch.Size] = {}

    def record(mod: nn.Module, inputs: tuple) -> None:
        shapes.setdefault(id(mod), inputs[0].shape)

    hooks = [m.register_forward_pre_hook(record) for m in noise]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return [shapes[id(m)] for m in noise]


def _explain(exc: BaseException) -> str:
    """The failing op (or our own message) out of the exporter's exception chain."""
    chain, seen = [], exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    for e in chain:
        if isinstance(e, ExportError):
            return str(e)
    for e in chain:
        text = str(e)
        if "Error when translating node" in text:
            line = text.split("Error when translating node", 1)[1].splitlines()[0]
            target = line.split("target=", 1)[1].split("]", 1)[0] if "target=" in line else line.strip()
            return (f"op {target.removeprefix('torch.ops.')} has no ONNX translation or failed to "
                    f"translate ({_first_line(chain[-1])})")
    return _first_line(chain[-1])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Silence the exporter's own chatter (torchvision ops it skips, a torch-internal
    deprecation) that says nothing about the user's model."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`", category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _no_unit_dims(value: object) -> Any:
    """A tensor with every size-1 dim repeated to 2, so a dynamic export keeps that dim dynamic;
    other values unchanged. A batch of one sample or a one-token example would otherwise give a
    graph that declares dynamic axes but runs only at that size."""
    if not isinstance(value, torch.Tensor):
        return value
    for dim, size in enumerate(value.shape):
        if size == 1:
            value = value.repeat_interleave(2, dim=dim)
    return value


def _torch_export(module: nn.Module, signature_model: nn.Module, example_inputs: ExampleInputs, *,
                  dynamic: bool, opset: int, log: list[dict], optimize: bool = False,
                  ) -> tuple[ModelProto, list[str]]:
    """torch.onnx.export of the wrapped module; returns the raw proto and the noise input names."""
    args, kwargs = normalize_inputs(signature_model, example_inputs)
    if dynamic:  # torch.export fixes every dim of size 1 to 1 ("0/1 specialization")
        args = tuple(_no_unit_dims(a) for a in args)
        kwargs = {k: _no_unit_dims(v) for k, v in kwargs.items()}
    tensor_kw = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    const_kw = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    noise = _noise_modules(module, log)
    noise_names = [name for name, _, _ in noise]
    z_shapes = _noise_shapes(module, args, kwargs, [m for _, _, m in noise])
    zs = tuple(torch.zeros(s) for s in z_shapes)
    wrapper = _Wrapper(module, len(args), list(tensor_kw), const_kw, [m for _, _, m in noise])
    wrapper.training = signature_model.training  # not .train(): it recurses; ep.module() refuses it
    inputs = (*args, *tensor_kw.values(), *zs)
    input_names = [f"input_{i}" for i in range(len(args))] + list(tensor_kw) + noise_names
    auto = torch.export.Dim.AUTO
    shapes = None
    if dynamic:
        specs = tuple({d: auto for d in range(t.dim())} for t in (*args, *tensor_kw.values()))
        specs += tuple({} if point == "weight" else {d: auto for d in range(z.dim() - 1)}
                       for z, (_, point, _) in zip(zs, noise, strict=True))
        shapes = (specs,)  # one entry: the wrapper's *tensors
    for m in module.modules():  # static and shared scales enter the graph as constants
        if isinstance(m, FakeQuantize):
            m.pin_amax()
    try:
        with _quiet_exporter(), traceable_experts(module):
            program = torch.onnx.export(
                wrapper, inputs, dynamo=True, opset_version=opset, input_names=input_names,
                dynamic_shapes=shapes, custom_translation_table=translation_table(), verbose=False,
                optimize=optimize,
            )
    except Exception as exc:
        raise ExportError(f"ONNX export of {type(signature_model).__name__} failed: {_explain(exc)}") from exc
    model = program.model_proto
    for out, name in zip(list(model.graph.output), wrapper.outputs.names, strict=True):  # set while tracing
        rename_value(model, out.name, name)
    return model, noise_names


# -- saving --------------------------------------------------------------------------------------
def save_model(model: ModelProto, path: str | os.PathLike, *, external_data_threshold: int = PROTO_LIMIT) -> Path:
    """Write atomically (`core.io.atomic_files`). A model larger than `external_data_threshold`
    bytes keeps its tensors in `<name>.data` beside it; a smaller one removes a stale one."""
    dest = Path(path)
    data_name = dest.name + ".data"
    external = model.ByteSize() > external_data_threshold
    with atomic_files(dest, data_name) as tmp:
        onnx.save_model(model, tmp / dest.name, save_as_external_data=external,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        if external:
            onnx.checker.check_model(str(tmp / dest.name))
    return dest


def check_opset(fake_quant: str, opset: int | None) -> int:
    """The opset to export with (the mode's default for None); an unusable one is a UserError."""
    if opset is None:
        opset = QDQ_OPSET if fake_quant == "qdq" else DEFAULT_OPSET
    if opset < 19 or (fake_quant == "qdq" and opset < QDQ_OPSET):
        need = QDQ_OPSET if fake_quant == "qdq" else 19
        raise UserError(f"opset {opset} is too old for fake_quant={fake_quant!r}: use opset >= {need}")
    if opset > onnx.defs.onnx_opset_version():
        raise UserError(f"opset {opset} does not exist yet: this onnx {onnx.__version__} knows opsets "
                        f"up to {onnx.defs.onnx_opset_version()}; use opset {DEFAULT_OPSET}")
    return opset


# -- the entry point -------------------------------------------------------------------------
def export_onnx(
    model_or_program: nn.Module | Program,
    path: str | os.PathLike,
    example_inputs: ExampleInputs,
    *,
    dynamic: bool = True,
    fake_quant: str = "function",
    taps: bool = True,
    noise: str = "input",
    opset: int | None = None,
    external_data_threshold: int = PROTO_LIMIT,
    attention_mask: bool = False,
    optimize: bool = False,
) -> Path:
    """Export a transformed model (or Program) to `path` and return the path.

    fake_quant: "function" (opaque `qtransform.<FORMAT>FakeQuant` nodes with local function
    bodies, bit-exact in onnxruntime), "inline" (bodies expanded into the graph) or "qdq"
    (QuantizeLinear/DequantizeLinear, opset >= 24, for deployment toolchains; onnxruntime 1.31
    cannot run it). taps: graph outputs `tap:<site>:<point>`. noise: "input" (graph inputs
    `noise:<site>/<point>`, each kind's neutral draw disables: zeros for additive and relative
    noise), "random" (seeded draws of each kind's distribution) or "off".
    `example_inputs`: a dict of keyword tensors (`{"input_ids": ids}`), a tuple or one tensor.
    attention_mask: add an `attention_mask` input (all ones in the example) beside `input_ids`,
    dynamic like it, so left- or right-padded batches run through the file.
    optimize: run onnxscript's graph optimizer inside torch.onnx (constant folding, a graph of
    fewer nodes). Off by default: on SmolLM2-135M it is about half of the export's time, and
    onnxruntime optimizes the graph itself when it opens the file, so the outputs are the same
    (docs/benchmarks.md).
    """
    if fake_quant not in FAKE_QUANT_MODES:
        raise UserError(f"fake_quant must be one of {', '.join(FAKE_QUANT_MODES)}, got {fake_quant!r}")
    if noise not in NOISE_MODES:
        raise UserError(f"noise must be one of {', '.join(NOISE_MODES)}, got {noise!r}")
    opset = check_opset(fake_quant, opset)
    module, signature_model, log = _log_of(model_or_program)
    if attention_mask:
        example_inputs = with_attention_mask(signature_model, example_inputs)
    model, noise_inputs = _torch_export(module, signature_model, example_inputs,
                                        dynamic=dynamic, opset=opset, log=log, optimize=optimize)
    labels = finish_fake_quant(model, opset)
    finish_rotations(model, opset, log)
    audit(labels, log)
    name_dims(model)
    finish_taps(model, taps)
    finish_noise(model, noise, noise_inputs, opset)
    model.ir_version = max(model.ir_version, 10)  # function overloads
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    if fake_quant == "inline":
        model = inline_functions(model)
    elif fake_quant == "qdq":
        model = to_qdq(model)
    if model.ByteSize() <= external_data_threshold:
        onnx.checker.check_model(model)
    return save_model(model, path, external_data_threshold=external_data_threshold)
