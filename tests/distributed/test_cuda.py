"""CUDA: every public operation on CUDA tensors gives the bits it gives on CPU (formats, quantized
weights of every pass, weight-scan rows, rollout weights), the Triton fast path equals the
reference path on the GPU, and scans and ONNX export run on a model that lives on CUDA.

Skipped without a GPU (the kernels themselves are checked on CPU by tests/formats/test_triton_kernels.py
under Triton's interpreter). Matmuls differ between CPU and GPU libraries, so activations and
logits are compared with tolerances; everything a format computes is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.formats import fake_quantize
from qtransform.formats.quantize import quantize_with_info
from qtransform.models import build_tiny
from tests.conftest import ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
FORMATS = [
    ("mxfp4", {}), ("mxfp4", {"scale_rule": "rceil"}), ("mxfp4", {"rounding": "rna"}),
    ("mxfp6_e2m3", {}), ("mxfp6_e3m2", {}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {}),
    ("mxint8", {}), ("nvfp4", {}), ("nvfp4", {"nvfp4_variant": "compressed-tensors"}),
    ("nvfp4", {"nvfp4_variant": "one_level"}), ("int4", {}), ("int8", {"block_size": 32}),
    ("mxfp4", {"block_shape": (32, 32)}), ("mxfp4", {"rounding": "stochastic", "seed": 5}),
    ("nvfp4", {"rounding": "stochastic", "seed": 9}),
]


def data(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g) * torch.logspace(-20, 20, 300)
    x[3, 7], x[4, 9], x[5, :40] = float("nan"), float("inf"), -0.0
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(BITS[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fmt", "opts"), FORMATS)
def test_formats_on_cuda_give_the_cpu_bits(fmt, opts, dtype, monkeypatch):
    """Fast path (Triton where it applies), reference path on the GPU, and CPU: the same bits,
    saturation masks included."""
    x = data(dtype)
    cpu, cpu_sat, _ = quantize_with_info(x, fmt, **opts)
    gpu, gpu_sat, _ = quantize_with_info(x.cuda(), fmt, **opts)
    assert gpu.device.type == "cuda"
    assert torch.equal(bits(gpu), bits(cpu))
    assert torch.equal(gpu_sat.cpu(), cpu_sat)
    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")  # the reference path, on the GPU
    assert torch.equal(bits(fake_quantize(x.cuda(), fmt, **opts)), bits(cpu))


def test_triton_path_is_taken_on_cuda():
    """The GPU fast path runs for what it covers (not silently the reference path)."""
    pytest.importorskip("triton")
    from qtransform.formats import triton_kernels
    from qtransform.formats.options import resolve
    from qtransform.formats.quantize import layout_for

    x = data(torch.bfloat16).cuda()
    cfg = resolve("mxfp4")
    res = triton_kernels.quantize(x, cfg, layout_for(x, cfg), want_sat=False)
    assert res is not None
    assert torch.equal(bits(res[0].reshape(x.shape)), bits(fake_quantize(x.cpu(), "mxfp4")))


ALL_PASSES = {
    "version": 1,
    "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
                  "tensors": ["weight"]},
                 {"targets": ["*.down_proj"], "format": "mxfp8_e4m3", "tensors": ["input"]}],
    "noise": {"targets": ["RMSNorm"], "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-3,
                                                   "num_stages": 2, "total_steps": 10}},
    "hw_error": {"targets": ["*.o_proj"], "error_type": "relative_gaussian", "error_scale": 0.05},
    "instrument": {"targets": ["*.down_proj"], "points": ["input", "output"]},
}


def test_every_pass_on_a_cuda_model():
    """A model on CUDA, transformed with every pass: the fake-quantized weights are the CPU's
    bits and the logits agree with the CPU's to matmul precision."""
    model = build_tiny("qwen2")
    cpu = qtransform.transform(model, ALL_PASSES)
    gpu = qtransform.transform(model.cuda(), ALL_PASSES)
    batch = ids(2, 8)
    with torch.no_grad():
        out_cpu = cpu(batch, use_cache=False).logits
        out_gpu = gpu(batch.cuda(), use_cache=False).logits
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-3, atol=1e-3)
    q = "model.layers.0.mlp.gate_proj"
    wq_cpu = cpu.get_submodule(q).weight_fake_quant(cpu.get_submodule(q).weight)
    wq_gpu = gpu.get_submodule(q).weight_fake_quant(gpu.get_submodule(q).weight)
    assert torch.equal(bits(wq_gpu), bits(wq_cpu))


def test_rollout_weights_on_cuda_give_the_cpu_bits():
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"],
                                          "format": "mxfp4"}]}
    model = build_tiny("qwen2")
    cpu = dict(qtransform.rollout_weights(qtransform.transform(model, policy)))
    gpu = dict(qtransform.rollout_weights(qtransform.transform(model.cuda(), policy)))
    assert cpu.keys() == gpu.keys()
    for name, tensor in cpu.items():
        assert gpu[name].device.type == "cuda"
        assert torch.equal(bits(gpu[name]), bits(tensor)), name


def test_scans_on_cuda():
    """Weight scans give the CPU's rows exactly; activation scans the CPU's numbers to matmul
    precision (weight rows exactly)."""
    model = build_tiny("qwen2")
    w_cpu = qtransform.scan_weights(model, "mxfp4")
    w_gpu = qtransform.scan_weights(model.cuda(), "mxfp4")
    assert [r.metrics for r in w_gpu.rows] == [r.metrics for r in w_cpu.rows]
    calib = ids(4, 16)
    a_cpu = qtransform.scan_activations(build_tiny("qwen2"), "mxfp4", calib)
    a_gpu = qtransform.scan_activations(model, "mxfp4", calib.cuda())
    assert [(r.site, r.point) for r in a_gpu.rows] == [(r.site, r.point) for r in a_cpu.rows]
    for r_gpu, r_cpu in zip(a_gpu.rows, a_cpu.rows, strict=True):
        if r_cpu.point == "weight":
            assert r_gpu.metrics == r_cpu.metrics
        else:
            assert r_gpu.metrics["sqnr_db"] == pytest.approx(r_cpu.metrics["sqnr_db"], abs=0.05)


def test_onnx_export_of_a_cuda_model(tmp_path):
    """A transformed model living on CUDA exports; the ONNX graph is the CPU export's."""
    import onnx

    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"],
                                          "format": "mxfp4"}]}
    model = build_tiny("qwen2")
    cpu = qtransform.transform(model, policy)
    gpu = qtransform.transform(build_tiny("qwen2").cuda(), policy)
    qtransform.export_onnx(cpu, tmp_path / "cpu.onnx", ids(1, 8))
    qtransform.export_onnx(gpu, tmp_path / "gpu.onnx", ids(1, 8).cuda())
    ops = [[n.op_type for n in onnx.load(tmp_path / f"{d}.onnx").graph.node] for d in ("cpu", "gpu")]
    assert ops[0] == ops[1]
