"""Every registered noise kind: its ONNX form in onnxruntime equals its PyTorch form bit for bit.

Parametrized over `noise_kinds()`, so a new kind is checked without an edit: random values
(with zeros, signed zeros and large magnitudes), random draws of the kind's distribution and
random scales, in fp32 and fp16, through the custom op and its ONNX function body. And the
export's audit of noise nodes.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import qtransform  # noqa: F401 - registers every pass's noise kinds
from qtransform.core.noise_kinds import noise_kinds
from qtransform.export.functions import DOMAIN, ExportError
from qtransform.export.graph import finish_noise, noise_function

DTYPES = {torch.float32: (TensorProto.FLOAT, np.float32), torch.float16: (TensorProto.FLOAT16, np.float16)}
OPSET = 21


def session(kind: str, scale: float, dtype: torch.dtype) -> ort.InferenceSession:
    body = noise_function(kind, scale, OPSET, "probe")
    elem = DTYPES[dtype][0]
    graph = helper.make_graph(list(body.node), "noise",
                              [helper.make_tensor_value_info("X", elem, None),
                               helper.make_tensor_value_info("Z", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype", list(DTYPES), ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", [k.name for k in noise_kinds()])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 0.95, allow_subnormal=False))
def test_onnx_form_equals_the_op_bit_for_bit(kind, dtype, seed, scale):
    spec = next(k for k in noise_kinds() if k.name == kind)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 33, generator=g) * 10 ** torch.randint(-3, 4, (4, 33), generator=g)).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, 1.0])
    z = torch.randn(4, 33, generator=g) if spec.draw == "normal" else torch.rand(4, 33, generator=g)
    want = torch.ops.qtransform.noise(x, z, scale, kind, "probe")
    got = session(kind, scale, dtype).run(None, {"X": x.numpy(), "Z": z.numpy()})[0]
    assert got.dtype == DTYPES[dtype][1]
    assert torch.equal(torch.from_numpy(got).view(torch.int16 if dtype == torch.float16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.float16 else torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", [k.name for k in noise_kinds() if k.apply_fresh is not None])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.0, 0.95, allow_subnormal=False))
def test_apply_on_a_fresh_draw_equals_apply_bit_for_bit(kind, dtype, seed, scale):
    """A module's own draw goes through `apply_fresh`, which overwrites it, or `apply_inplace`,
    which also overwrites x: the same bits as `apply` (what the op, the gradient and the ONNX
    form are checked against)."""
    spec = next(k for k in noise_kinds() if k.name == kind)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 33, generator=g) * 10 ** torch.randint(-3, 4, (4, 33), generator=g)).to(dtype)
    z = torch.randn(4, 33, generator=g)
    want = spec.apply(x, z, scale)
    got = spec.apply_fresh(x, z.clone(), scale)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))
    if spec.apply_inplace is not None:  # written into x itself (a linear's own output)
        into = x.clone()
        got = spec.apply_inplace(into, z.clone(), scale)
        assert got.data_ptr() == into.data_ptr()
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_a_hardware_error_forward_equals_the_kinds_apply_on_its_stream_draw():
    """The module's forward gives the kind's formula on draw k of step 0 of its stream (the
    counter-based Gaussian stream), bit for bit: with a gradient (draw, then formula) and without
    (draw and formula fused in one compiled pass), and keeps the gradient of that formula."""
    from qtransform.formats import philox
    from qtransform.passes.hw_error import HWError

    for error_type in ("relative_gaussian", "absolute_gaussian"):
        module = HWError(error_type, 0.05, "probe/output_hw_error", seed=3, apply_during="both")
        x = torch.randn(8, 16, requires_grad=True)
        y = module(x)
        z = module.sample(x.shape, x, 0)
        assert torch.equal(z, philox.normal(module.stream.seed_at(0), (8, 16)))
        spec = next(k for k in noise_kinds() if k.name == module.kind)
        assert torch.equal(y, spec.apply(x.detach(), z, 0.05))
        y.sum().backward()
        assert torch.equal(x.grad, spec.grad(torch.ones(8, 16), z, 0.05))
        with torch.no_grad():
            fused = module(x)  # draw 1
        assert torch.equal(fused, spec.apply(x.detach(), module.sample(x.shape, x, 1), 0.05))


@pytest.mark.parametrize("kind", [k.name for k in noise_kinds()])
def test_the_neutral_draw_and_scale_zero_leave_x_unchanged(kind):
    spec = next(k for k in noise_kinds() if k.name == kind)
    x = torch.randn(64)
    z = torch.rand(64)
    assert torch.equal(spec.apply(x, z, 0.0), x)
    if spec.neutral is not None:
        assert torch.equal(spec.apply(x, torch.full((64,), spec.neutral), 0.3), x)


@pytest.mark.parametrize("kind", [k.name for k in noise_kinds()])
def test_the_op_gradient_is_the_kinds_gradient(kind):
    spec = next(k for k in noise_kinds() if k.name == kind)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, generator=g, requires_grad=True)
    z = torch.randn(32, generator=g) if spec.draw == "normal" else torch.rand(32, generator=g)
    torch.ops.qtransform.noise(x, z, 0.4, kind, "probe").backward(torch.ones(32))
    eager = x.detach().clone().requires_grad_()
    spec.apply(eager, z, 0.4).backward(torch.ones(32))  # autograd through the eager formula
    assert torch.equal(x.grad, eager.grad)


def test_a_noise_insertion_without_its_node_fails_the_audit():
    """The exporter names one graph input per noise module; an input no `Noise` node reads means
    the node was folded or dropped, and the file would silently compute without that noise."""
    noise = helper.make_node("Noise", ["x", "noise:a/output"], ["y"], domain=DOMAIN, label="a/output_hw_error",
                             kind="relative", scale=0.5)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "noise:a/output",
                                                                                  "noise:b/output")]
    graph = helper.make_graph([noise], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph)
    with pytest.raises(ExportError) as info:
        finish_noise(model, "input", ["noise:a/output", "noise:b/output"], OPSET)
    assert str(info.value) == ("audit failed: 1 of 2 noise insertions have no noise node in the exported graph "
                               "(folded or dropped): noise:b/output")
    finish_noise(model, "input", ["noise:a/output"], OPSET)  # every input read: the node gets its body
    assert model.graph.node[0].name == "a/output_hw_error" and [f.overload for f in model.functions] == ["relative_0p5"]
