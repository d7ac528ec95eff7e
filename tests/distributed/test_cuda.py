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
    ("fp8_e4m3", {}), ("fp8_e4m3", {"granularity": "channel"}), ("fp8_e5m2", {"granularity": "tensor"}),
    ("fp8_e4m3", {"granularity": "tensor", "fp8_variant": "modelopt"}),
    ("fp8_e4m3", {"block_size": 100, "scale_dtype": "input"}),
    ("int8", {"granularity": "token", "int_range": "full"}), ("int4", {"int_range": "modelopt"}),
    ("mxfp8_e4m3", {"scale_rule": "compressed-tensors"}),
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


def test_triton_kernels_compiled_on_the_gpu_match_the_reference(monkeypatch):
    """The kernels compiled for the device (not the interpreter) on the adversarial rows of
    tests/formats/test_triton_kernels.py (ties, powers of two, E4M3 edges, subnormals, NaN/Inf,
    signed zeros), every covered case and dtype, along the last axis and axis 0: values as bits
    and saturation masks equal the reference path's on CPU."""
    pytest.importorskip("triton")
    from qtransform.formats import saturated, triton_kernels
    from qtransform.formats.options import resolve
    from qtransform.formats.quantize import layout_for
    from tests.formats.test_triton_kernels import CASES, adversarial

    monkeypatch.setenv("QTRANSFORM_FASTPATH", "0")  # the torch reference, on CPU
    checked = 0
    for fmt, opts in CASES:
        for dtype in BITS:
            for axis, shape in ((-1, (12, 70)), (-1, (256, 4096)), (0, (6, 64))):
                x = adversarial(*shape, seed=len(fmt) + shape[0]).to(dtype)
                if axis == 0:  # the special values then run down a column, in axis-0 blocks
                    x = x.T.contiguous()
                cfg = resolve(fmt, axis=axis, **opts)
                xg = x.cuda()
                layout = layout_for(xg, cfg)
                assert triton_kernels.supported(xg, cfg, layout, exponents=False)
                out, sat = triton_kernels.run(xg, cfg, layout, want_sat=True)
                want = fake_quantize(x, fmt, axis=axis, **opts)
                got = out.reshape(x.shape)
                assert torch.equal(bits(got), bits(want)), (
                    f"{fmt} {opts} {dtype} axis {axis}: {(bits(got) != bits(want)).sum()} differ")
                assert torch.equal(sat.reshape(x.shape).cpu(),
                                   saturated(x, fmt, axis=axis, **opts))
                checked += 1
    assert checked == len(CASES) * len(BITS) * 3


@pytest.mark.parametrize("variant", ["default", "compressed-tensors", "one_level"])
def test_nvfp4_adversarial_rows_on_the_gpu(variant):
    """Rows where the fp32 order of operations changes NVFP4's result
    (tests/data/nvfp4-adversarial.json, expected values from an independent numpy model)."""
    from tests.formats.test_formats_nvfp4_order import CASES, _t

    for case in CASES:
        out = fake_quantize(_t(case["input_hex"]).cuda(), "nvfp4", nvfp4_variant=variant)
        want = _t(case["expected"][variant]["out_hex"])
        assert torch.equal(bits(out), want.view(torch.int32)), case["name"]


ALL_PASSES = {
    "version": 1,
    "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
                  "tensors": ["weight"]},
                 {"targets": ["*.down_proj"], "format": "mxfp8_e4m3", "tensors": ["input"]}],
    "noise": {"targets": ["RMSNorm"], "schedule": {"sigma_start": 1e-2, "sigma_end": 1e-3,
                                                   "num_stages": 3, "total_steps": 10}},
    "hw_error": {"targets": ["*.o_proj"], "error_type": "relative_gaussian", "error_scale": 0.05},
    "instrument": {"targets": ["*.down_proj"], "points": ["input", "output"]},
}


def test_every_pass_on_a_cuda_model():
    """A model on CUDA, transformed with every pass: the fake-quantized weights and the AQN-noised
    norm weights are the CPU's bits (AQN draws on the CPU), the logits without noise agree with
    the CPU's to matmul precision, and the hardware error (drawn on the device: CUDA's generator
    is another stream than the CPU's) has the configured relative spread."""
    model = build_tiny("qwen2")
    cpu = qtransform.transform(model, ALL_PASSES)
    gpu = qtransform.transform(model.cuda(), ALL_PASSES)
    batch = ids(2, 8)
    with torch.no_grad(), qtransform.noise_controller(cpu).disabled(), \
            qtransform.noise_controller(gpu).disabled():
        out_cpu = cpu(batch, use_cache=False).logits
        out_gpu = gpu(batch.cuda(), use_cache=False).logits
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-3, atol=1e-3)
    for m in (cpu, gpu):
        qtransform.noise_controller(m).set_step(5)
    norm = "model.layers.1.post_attention_layernorm"
    noised = [dict(m.named_modules())[norm].weight_aqn_noise for m in (cpu, gpu)]
    with qtransform.rollout():
        w_cpu, w_gpu = (n(n.z.new_ones(n.z.shape)) for n in noised)
    assert not torch.equal(w_cpu, torch.ones_like(w_cpu))
    assert torch.equal(bits(w_gpu), bits(w_cpu))
    hw = gpu.get_submodule("model.layers.0.self_attn.o_proj").output_hw_error
    y = hw(torch.ones(512, 1024, device="cuda"))
    assert y.device.type == "cuda"
    assert (y - 1).std().item() == pytest.approx(0.05, rel=0.02)
    assert (y - 1).mean().abs().item() < 1e-3
    q = "model.layers.0.mlp.gate_proj"
    wq_cpu = cpu.get_submodule(q).weight_fake_quant(cpu.get_submodule(q).weight)
    wq_gpu = gpu.get_submodule(q).weight_fake_quant(gpu.get_submodule(q).weight)
    assert torch.equal(bits(wq_gpu), bits(wq_cpu))


def test_rollout_weights_on_cuda_give_the_cpu_bits():
    """Quantized linears and AQN-noised norms alike."""
    policy = {"version": 1, "quantize": [{"targets": ["Linear"], "ignore": ["lm_head"],
                                          "format": "mxfp4"}], "noise": ALL_PASSES["noise"]}
    model = build_tiny("qwen2")
    transformed = [qtransform.transform(model, policy), qtransform.transform(model.cuda(), policy)]
    for m in transformed:
        qtransform.noise_controller(m).set_step(4)
    cpu, gpu = (dict(qtransform.rollout_weights(m)) for m in transformed)
    assert cpu.keys() == gpu.keys()
    for name, tensor in cpu.items():
        assert gpu[name].device.type == "cuda"
        assert torch.equal(bits(gpu[name]), bits(tensor)), name


def assert_rows_match(gpu_rows: list, cpu_rows: list) -> None:
    assert len(gpu_rows) == len(cpu_rows)
    for g, c in zip(gpu_rows, cpu_rows, strict=True):
        assert g.metrics.keys() == c.metrics.keys()
        for key, want in c.metrics.items():
            if isinstance(want, int):
                assert g.metrics[key] == want, (g.site, key)
            else:
                assert g.metrics[key] == pytest.approx(want, rel=1e-9, abs=1e-300), (g.site, key)


def test_scans_on_cuda():
    """Weight scans give the CPU's rows: counts exactly, float64 sums to reduction order (the
    quantized values are the CPU's bits; the GPU adds them in another order); activation scans
    the CPU's numbers to matmul precision."""
    model = build_tiny("qwen2")
    w_cpu = qtransform.scan_weights(model, "mxfp4")
    w_gpu = qtransform.scan_weights(model.cuda(), "mxfp4")
    assert_rows_match(w_gpu.rows, w_cpu.rows)
    calib = ids(4, 16)
    a_cpu = qtransform.scan_activations(build_tiny("qwen2"), "mxfp4", calib)
    a_gpu = qtransform.scan_activations(model, "mxfp4", calib.cuda())
    assert [(r.site, r.point) for r in a_gpu.rows] == [(r.site, r.point) for r in a_cpu.rows]
    for r_gpu, r_cpu in zip(a_gpu.rows, a_cpu.rows, strict=True):
        if r_cpu.point == "weight":
            assert_rows_match([r_gpu], [r_cpu])
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
