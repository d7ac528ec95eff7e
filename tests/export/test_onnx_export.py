"""export_onnx on tiny config-built models: onnxruntime against PyTorch.

One dynamic export per architecture (module-scoped, exports are the slow part) with MXFP4
weights on attention, NVFP4 weights on the MLP and MXFP4 on every linear input (the W4A16 MXFP4,
NVFP4 W4A16 and W16A4 MXFP4 policies at once), run at two batch/sequence shapes. Fake-quant node
outputs must be bit-exact; logits and taps may differ only by the exporter's float reordering:
measured at most ~3e-7 of the logits' scale, asserted below LOGIT_RTOL.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import qtransform
from qtransform import fake_quantize
from qtransform.core.metrics import ErrorStats
from qtransform.export.graph import config_of, fake_quant_nodes
from qtransform.models import build_tiny
from tests.conftest import ids

LOGIT_RTOL = 1e-5  # max |onnx - torch| / max |torch| over the logits (measured <= ~3e-7)
SHAPES = ((2, 8), (3, 13))
MLP = {"qwen2": "*.mlp.*", "llama": "*.mlp.*", "gpt2": "*.mlp.*", "bert": "*.intermediate.dense"}


def policy(arch: str, *, extras: bool = False) -> dict:
    ignore = [] if arch == "bert" else ["lm_head"]
    rules = [
        {"name": "w4a16_mxfp4", "targets": ["Linear"], "ignore": ignore, "format": "mxfp4", "tensors": ["weight"]},
        {"name": "w4a16_nvfp4", "targets": [MLP[arch]], "format": "nvfp4", "tensors": ["weight"]},
        {"name": "w16a4_mxfp4", "targets": ["Linear"], "ignore": ignore, "format": "mxfp4", "tensors": ["input"]},
    ]
    pol: dict = {"version": 1, "quantize": rules}
    if extras:  # taps and a noise input
        pol["instrument"] = {"targets": ["*.down_proj"], "points": ["input", "output"]}
        pol["hw_error"] = {"targets": ["*.o_proj"], "error_type": "relative_gaussian", "error_scale": 0.05}
    return pol


class Exported:
    """A transformed model, its export, and an onnxruntime session that also returns every
    fake-quant node's input and output."""

    def __init__(self, arch: str, tmp: str, extras: bool = False):
        self.arch = arch
        self.float_model = build_tiny(arch, num_layers=1)
        self.model = qtransform.transform(self.float_model, policy(arch, extras=extras))
        self.path = qtransform.export_onnx(self.model, f"{tmp}/{arch}.onnx", {"input_ids": ids()})
        self.proto = onnx.load(self.path)
        probe = onnx.load(self.path)
        self.fq = [(n.name, n.input[0], n.output[0]) for n in fake_quant_nodes(probe)]
        for _, src, dst in self.fq:
            probe.graph.output.extend([helper.make_empty_tensor_value_info(src), helper.make_empty_tensor_value_info(dst)])
        self.session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]

    def run(self, x: torch.Tensor, noise: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        feeds = {"input_ids": x.numpy()} | (noise or {})
        for i in self.session.get_inputs():
            if i.name.startswith("noise:") and i.name not in feeds:
                shape = [x.shape[0], x.shape[1], *i.shape[2:]]
                feeds[i.name] = np.zeros(shape, np.float32)
        return dict(zip(self.names, self.session.run(None, feeds), strict=True))

    def torch_logits(self, x: torch.Tensor) -> torch.Tensor:
        """PyTorch's logits with every noise draw zero (the ONNX noise inputs' default here)."""
        zeroed = [m for m in self.model.modules() if getattr(m, "noise_override", 0) is None]

        def zeros(mod, args):
            mod.noise_override = torch.zeros_like(args[0])

        hooks = [m.register_forward_pre_hook(zeros) for m in zeroed]
        try:
            with torch.no_grad():
                return self.model(input_ids=x)[0]
        finally:
            for m, h in zip(zeroed, hooks, strict=True):
                h.remove()
                m.noise_override = None


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache: dict[str, Exported] = {}

    def get(arch: str) -> Exported:
        if arch not in cache:
            cache[arch] = Exported(arch, str(tmp_path_factory.mktemp(arch)), extras=arch == "qwen2")
        return cache[arch]

    return get


def bits_equal(a: np.ndarray, b: torch.Tensor) -> bool:
    a = torch.from_numpy(a)
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2", "bert"])
def test_onnxruntime_matches_pytorch_at_two_shapes_of_one_dynamic_export(exported, arch):
    ex = exported(arch)
    graph_inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                    for i in ex.proto.graph.input}
    assert graph_inputs["input_ids"] == ["batch", "sequence"]
    n_fq = sum(1 for e in qtransform.insertion_log(ex.model) if e.pass_name == "fake_quant")
    assert len(ex.fq) == n_fq and {n for n, _, _ in ex.fq} == {
        f"{e.site}/{e.point}_fake_quant" for e in qtransform.insertion_log(ex.model) if e.pass_name == "fake_quant"}
    formats_used = {config_of(n)[0].spec.name for n in fake_quant_nodes(ex.proto)}
    assert formats_used == {"mxfp4", "nvfp4"}
    for batch, seq in SHAPES:
        x = ids(batch, seq, seed=batch)
        out = ex.run(x)
        for label, src, dst in ex.fq:  # each fake-quant node: bit-exact on what it was given
            cfg, _ = config_of(next(n for n in fake_quant_nodes(ex.proto) if n.name == label))
            want = fake_quantize(torch.from_numpy(out[src]), cfg)
            assert bits_equal(out[dst], want), label
        ref = ex.torch_logits(x)
        got = out[ex.names[0]]
        assert got.shape == tuple(ref.shape)
        err = np.abs(got - ref.numpy()).max() / float(ref.abs().max())
        assert err <= LOGIT_RTOL, f"{arch} {batch}x{seq}: relative logit error {err:.2e}"


def test_weight_fake_quant_nodes_equal_the_reference_on_the_weights(exported):
    ex = exported("gpt2")  # Conv1D weights are blocked along axis 0
    weights = dict(ex.model.named_parameters())
    inits = {t.name for t in ex.proto.graph.initializer}
    out = ex.run(ids())
    checked = 0
    for label, src, dst in ex.fq:
        if src not in inits:
            continue
        site = label.rsplit("/", 1)[0]
        axis = 0 if type(ex.model.get_submodule(site)).__name__ == "Conv1D" else -1
        fmt = config_of(next(n for n in fake_quant_nodes(ex.proto) if n.name == label))[0].spec.name
        assert bits_equal(out[dst], fake_quantize(weights[f"{site}.weight"].detach(), fmt, axis=axis)), label
        checked += 1
    assert checked == 4  # c_attn, c_proj, mlp.c_fc, mlp.c_proj


def test_taps_are_named_outputs_equal_to_pytorch_and_give_the_same_sqnr(exported):
    ex = exported("qwen2")
    tap_outputs = [n for n in ex.names if n.startswith("tap:")]
    assert tap_outputs == ["tap:model.layers.0.mlp.down_proj:input", "tap:model.layers.0.mlp.down_proj:output"]
    site = ex.model.get_submodule("model.layers.0.mlp.down_proj")
    plain = ex.float_model.get_submodule("model.layers.0.mlp.down_proj")
    seen: dict[str, torch.Tensor] = {}
    hooks = [site.input_tap.register_forward_hook(lambda m, a, o: seen.__setitem__("input", o)),
             site.output_tap.register_forward_hook(lambda m, a, o: seen.__setitem__("output", o)),
             plain.register_forward_hook(lambda m, a, o: seen.update(raw_input=a[0], raw_output=o))]
    x = ids(3, 13, seed=7)
    try:
        ex.torch_logits(x)
        with torch.no_grad():
            ex.float_model(input_ids=x)
    finally:
        for h in hooks:
            h.remove()
    out = ex.run(x)
    for point in ("input", "output"):
        got, want = torch.from_numpy(out[f"tap:model.layers.0.mlp.down_proj:{point}"]), seen[point]
        assert torch.allclose(got, want, rtol=0, atol=LOGIT_RTOL * float(want.abs().max()))
        raw = seen[f"raw_{point}"]
        sqnr_onnx = ErrorStats().update(raw, got).result()["sqnr_db"]
        sqnr_torch = ErrorStats().update(raw, want).result()["sqnr_db"]
        assert abs(sqnr_onnx - sqnr_torch) < 1e-3, (point, sqnr_onnx, sqnr_torch)


def test_noise_inputs_zero_disable_and_a_draw_reproduces_pytorch(exported):
    ex = exported("qwen2")
    name = "noise:model.layers.0.self_attn.o_proj/output"
    graph_inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                    for i in ex.proto.graph.input}
    assert graph_inputs[name] == ["batch", "sequence", 64]
    doc = next(i.doc_string for i in ex.proto.graph.input if i.name == name)
    assert doc == ("draw z (normal, fp32) of model.layers.0.self_attn.o_proj/output_hw_error: relative noise "
                   "x*(1 + s*z); all 0 disables it")
    x = ids(2, 8, seed=3)
    module = ex.model.get_submodule("model.layers.0.self_attn.o_proj.output_hw_error")
    z = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    clean = ex.torch_logits(x)
    module.noise_override = z
    try:
        noisy = ex.torch_logits(x)
    finally:
        module.noise_override = None
    got_clean = ex.run(x)[ex.names[0]]
    got_noisy = ex.run(x, {name: z.numpy()})[ex.names[0]]
    scale = float(clean.abs().max())
    assert np.abs(got_clean - clean.numpy()).max() <= LOGIT_RTOL * scale
    assert np.abs(got_noisy - noisy.numpy()).max() <= LOGIT_RTOL * scale
    assert np.abs(got_noisy - got_clean).max() > 100 * LOGIT_RTOL * scale


@pytest.mark.parametrize("rule", [
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["weight"]},
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4", "tensors": ["weight"]},
    {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "tensors": ["input"]},
], ids=["w4a16_mxfp4", "w4a16_nvfp4", "w16a4_mxfp4"])
def test_each_parity_policy_alone_on_qwen2(tmp_path, rule):
    """The issue's three policies one at a time (the combined export above checks every node)."""
    model = qtransform.transform(build_tiny("qwen2", num_layers=1), {"version": 1, "quantize": [rule]})
    path = qtransform.export_onnx(model, tmp_path / "m.onnx", {"input_ids": ids()})
    proto = onnx.load(path)
    assert len(fake_quant_nodes(proto)) == 7
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq in SHAPES:
        x = ids(batch, seq, seed=batch)
        got = session.run(None, {"input_ids": x.numpy()})[0]
        with torch.no_grad():
            ref = model(input_ids=x).logits
        err = np.abs(got - ref.numpy()).max() / float(ref.abs().max())
        assert err <= LOGIT_RTOL, f"{rule['format']} {batch}x{seq}: relative logit error {err:.2e}"


def test_the_optimizer_changes_the_graph_not_the_numbers(tmp_path):
    """`optimize=True` runs onnxscript's optimizer (off by default: about half of the export's
    time on a real model); onnxruntime gives the same outputs for both files, bit for bit."""
    model = qtransform.transform(build_tiny("llama"), policy("llama"))
    x = ids(2, 7, seed=3)
    files = {opt: qtransform.export_onnx(model, tmp_path / f"m{opt}.onnx", {"input_ids": x}, optimize=opt)
             for opt in (False, True)}
    nodes = {opt: len(onnx.load(str(f)).graph.node) for opt, f in files.items()}
    assert nodes[True] < nodes[False]  # folded: the option does something
    outs = {}
    for opt, f in files.items():
        sess = ort.InferenceSession(str(f))
        outs[opt] = sess.run(None, {"input_ids": x.numpy()})
    for a, b in zip(outs[False], outs[True], strict=True):
        assert np.array_equal(a, b, equal_nan=True)
