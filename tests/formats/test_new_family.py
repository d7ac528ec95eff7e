"""A new format family is two modules: its numerics (registry record, reference kernel, formats)
and its ONNX form. This test is that claim: in a fresh process it adds an FP8 family with one
fp32 scale per tensor (amax / 448, the per-tensor FP8 of deployment toolchains) in exactly those
two pieces, without touching qtransform, and uses it through every public entry point:
`fake_quantize`, a JSON policy, `transform`, `plan`, `policy explain`, `scan_weights` and `export_onnx`
run in onnxruntime. The expected values come from ml_dtypes' float8_e4m3fn cast, not from
qtransform. (docs/architecture.md, "Extending", counts the files.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys, tempfile
    import ml_dtypes, numpy as np, onnx, onnxruntime as ort, torch
    import qtransform
    from qtransform.models import build_tiny

    # -- module 1, "formats/fp8tensor.py": the family record, its kernel and its format -------
    from qtransform.formats.blocking import BlockQuant
    from qtransform.formats.elements import round_signed
    from qtransform.formats.registry import (
        E4M3, ROUNDINGS, Family, FormatSpec, register, register_family)

    def quantize(blocks, cfg, u, amax_t):
        scale = amax_t / 448.0
        scale = torch.where(scale == 0, 1.0, scale)
        y = blocks / scale
        q = round_signed(torch.clamp(y, -448.0, 448.0), E4M3, cfg.rounding, u)
        return BlockQuant(out=q * scale, q=q, sat=y.abs() > 448.0,
                          scales=scale.expand(blocks.shape[0]).clone(), tensor_scale=scale)

    FP8T = register_family(Family("fp8_tensor", {"rounding": ROUNDINGS}, quantize=quantize,
                                  scale_values=lambda s, t, cfg: s, per_tensor=lambda cfg: True))
    register(FormatSpec(name="fp8_e4m3_tensor", family=FP8T, element=E4M3, default_block=32,
                        scale="fp32_tensor", tile=(32, 32), onnx_op="FP8E4M3TensorFakeQuant",
                        description="FP8 E4M3, one fp32 scale per tensor (amax / 448)"))

    # -- module 2, "export/families/fp8tensor.py": its ONNX form ------------------------------
    from qtransform.export import functions as F

    def blocks(b, x, axes, cfg):
        s = b.op("Div", F.amax_nan(b, x, None), b.const(448.0))
        s = b.op("Where", b.op("Equal", s, b.const(0.0)), b.const(1.0), s)
        y = b.op("Max", b.op("Min", b.op("Div", x, s), b.const(448.0)), b.const(-448.0))
        return b.op("Mul", F.round_signed(b, y, E4M3, cfg.rounding), s)

    F.register_onnx_family("fp8_tensor", F.OnnxFamily(
        blocks, weight_scale=None, activation_scale=None))

    # -- using it -----------------------------------------------------------------------------
    def expected(x):
        """ml_dtypes' saturating-free RNE cast after the fp32 division by amax / 448."""
        a = x.detach().float().numpy()
        s = np.float32(np.abs(a).max()) / np.float32(448.0)
        s = np.float32(1.0) if s == 0 else s
        y = np.clip(a / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return torch.from_numpy(y * s)

    out = {}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 96, generator=g) * torch.logspace(-3, 2, 96)
    x[3] = 0.0
    got = qtransform.fake_quantize(x, "fp8_e4m3_tensor")
    out["fake_quantize_bits_differ"] = int((got.view(torch.int32) != expected(x).view(torch.int32)).sum())
    out["zeros"] = qtransform.fake_quantize(torch.zeros(4, 8), "fp8_e4m3_tensor").abs().sum().item()
    from qtransform.formats.expected import effective_bits
    out["bits"] = [effective_bits("fp8_e4m3_tensor"), effective_bits("fp8_e4m3_tensor", numel=4096)]

    policy = {"version": 1, "quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head"], "format": "fp8_e4m3_tensor"}]}
    model = build_tiny("qwen2").eval()
    q = qtransform.transform(model, policy)
    lin = "model.layers.0.self_attn.q_proj"
    w = model.get_submodule(lin).weight
    h = torch.randn(2, 5, w.shape[1], generator=g)
    want = torch.nn.functional.linear(h, expected(w), model.get_submodule(lin).bias)
    out["linear_max_diff"] = (q.get_submodule(lin)(h) - want).abs().max().item()
    out["plan"] = [r.detail for r in qtransform.plan(model, policy).rows if r.site == lin]
    from qtransform.schemas import load_policy
    from qtransform.schemas.explain import explain
    text = explain(load_policy(policy))
    out["explain"] = [l for l in text.splitlines() if "FP8_E4M3_TENSOR" in l]
    rep = qtransform.scan_weights(model, "fp8_e4m3_tensor")
    out["scan_rows"] = len(rep.rows)

    ids = torch.randint(0, 256, (2, 8), generator=g)
    with tempfile.TemporaryDirectory() as d:
        path = qtransform.export_onnx(q, f"{d}/m.onnx", (ids,), taps=False)
        proto = onnx.load(str(path))
        out["onnx_nodes"] = sum(n.op_type == "FP8E4M3TensorFakeQuant" for n in proto.graph.node)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        onnx_logits = sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0]
    with torch.no_grad():
        torch_logits = q(ids).logits.numpy()
    out["onnx_max_diff"] = float(np.abs(onnx_logits - torch_logits).max())
    out["linears"] = sum(1 for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and n != "lm_head")
    print(json.dumps(out))
''')


def test_a_new_family_is_two_modules_and_works_everywhere():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fake_quantize_bits_differ"] == 0 and out["zeros"] == 0.0
    assert out["bits"] == [8.0, 8 + 32 / 4096]  # one fp32 scale per tensor, no block scales
    assert out["linear_max_diff"] < 1e-5
    assert out["plan"] == ["fp8_e4m3_tensor block=32, rounding=rne"]
    assert len(out["explain"]) == 1 and "E4M3 elements" in out["explain"][0]
    assert "FP32 tensor scale" in out["explain"][0]
    assert out["scan_rows"] == out["linears"] + 1  # every Linear and lm_head
    assert out["onnx_nodes"] == out["linears"]
    assert out["onnx_max_diff"] < 1e-4
