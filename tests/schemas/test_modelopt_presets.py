"""The `modelopt/...` presets against NVIDIA ModelOpt's own numbers (tests/data/modelopt-golden.safetensors).

ModelOpt is not installed here: tests/data/make_modelopt_golden.py ran nvidia-modelopt 0.47.0 on
CPU on the same tiny Qwen2 and stored what it computed: the calibrated amax of every Linear
(`mtq.quantize`), the fake-quantized logits where its fake quantization runs on CPU (FP8,
INT4), and, where it needs CUDA (NVFP4, MXFP8), the weights its export
writes into the deployed checkpoint. docs/recipes.md records each comparison.

The weights and the fake quantization of stored tensors are elementwise: bit for bit on any
machine. The calibrated amaxes and the logits come out of whole forwards, whose float32 GEMMs
and reductions sum in an order that follows the CPU (MKL's and ATen's kernels per instruction
set): they are compared bit for bit where this CPU reproduces the golden run's full-precision
logits bit for bit (`same_gemms`), and elsewhere the amaxes within that rounding, while the
fake-quantized logits cannot be compared at all (a 1-ulp difference in an activation can flip
one of its roundings, a whole quantization step).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import qtransform
from qtransform.checkpoints.matching import MODELOPT_QUANTIZERS
from qtransform.checkpoints.matching import modelopt_entry as from_modelopt
from qtransform.core.observers import StaticScale
from qtransform.core.sites import Site
from qtransform.models import build_tiny
from qtransform.schemas import load_policy
from qtransform.schemas.presets.modelopt import DISABLED, IGNORE
from qtransform.schemas.selectors import compile_entry

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "modelopt-golden.safetensors"
LAYER0 = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
    f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
FUSED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(GOLDEN), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()


@pytest.fixture(scope="module")
def model(golden) -> torch.nn.Module:
    tensors, meta = golden
    model = build_tiny("qwen2")
    assert repr(sum(float(p.detach().double().sum()) for p in model.parameters())) == meta["param_sum"]
    with torch.no_grad():
        got, want = model(input_ids=tensors["ids"]).logits, tensors["fp.logits"]
    # the golden machine's GEMMs, not this one's: equal up to float32 summation order
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    return model


@pytest.fixture(scope="module")
def same_gemms(golden, model) -> bool:
    """Whether this CPU's float32 forward gives the golden run's full-precision logits bit for
    bit (the machine that wrote the file did; a CPU with other vector units may not)."""
    with torch.no_grad():
        return torch.equal(model(input_ids=golden[0]["ids"]).logits, golden[0]["fp.logits"])


def _preset(name: str, model: torch.nn.Module, calib=None) -> torch.nn.Module:
    return qtransform.transform(model, {"version": 1, "preset": f"modelopt/{name}"}, calibration=calib)


# -- ModelOpt's disabled list, as qtransform selectors -------------------------------------------
NAMES = ["lm_head", "model.lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.gate_up_proj",
         "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.experts.gate_up_proj", "mlp.gate",
         "model.layers.3.mlp.shared_expert_gate", "model.layers.3.mlp.shared_expert.gate_proj",
         "model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.router", "router.layer",
         "output", "outputs", "output.dense", "model.output", "mtp", "mtp.0.proj", "model.mtp.0",
         "proj_out", "decoder.proj_out", "decoder.proj_outer", "model.visual.blocks.0.qkv",
         "model.layers.0.self_attn.q_proj", "model.layers.0.linear_attn.in_proj_a",
         "model.layers.0.linear_attn.in_proj_ba", "model.layers.0.mixer.conv1d", "output_layer"]


def _modelopt_disables(name: str, patterns: list[str]) -> bool:
    """ModelOpt's own rule: fnmatch on the module's quantizer names."""
    return any(fnmatch.fnmatchcase(name + suffix, p) for suffix in MODELOPT_QUANTIZERS for p in patterns)


def _selected(entry: str, name: str) -> bool:
    return compile_entry(entry).matches(Site(name, "Linear", "linear", None, "other"))


@pytest.mark.parametrize("name", NAMES)
def test_the_disabled_list_selects_what_modelopt_disables(name):
    assert _selected(IGNORE[0], name) is _modelopt_disables(name, DISABLED)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["model", "layers", "0", "mlp", "gate", "gate_up_proj", "router",
                                 "output", "mtp", "proj_out", "lm_head", "visual", "x", "shared_expert_gate"]),
                min_size=1, max_size=5),
       st.lists(st.sampled_from(DISABLED), min_size=1, max_size=4))
def test_from_modelopt_equals_fnmatch_on_quantizer_names(parts, patterns):
    name = ".".join(parts)
    assert _selected(from_modelopt(patterns), name) is _modelopt_disables(name, patterns)


@pytest.mark.parametrize("bad", ["lm_head", "*", "*weight*", "*mlp.[gu]*", "a*b*"])
def test_untranslatable_patterns_are_refused(bad):
    with pytest.raises(ValueError, match="only"):
        from_modelopt([bad])


def test_routers_and_lm_head_are_left_out_on_a_moe_model():
    model = build_tiny("qwen2_moe", num_layers=1)
    plan = qtransform.plan(model, {"version": 1, "preset": "modelopt/MXFP8_DEFAULT_CFG"})
    acted = {r.site for r in plan.rows}
    assert "model.layers.0.mlp.experts.gate_up_proj" in acted
    assert not acted & {"lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"}
    assert not plan.skipped  # ModelOpt's list ignores them by name: nothing is skipped silently


# -- numbers ------------------------------------------------------------------------------------
def test_calibration_observes_the_full_precision_model_as_modelopt_does(golden, model, same_gemms):
    """ModelOpt's max calibration collects with every quantizer off; so does qtransform's
    calibration pass: the static input amax of every Linear equals ModelOpt's, bit for bit where
    this CPU sums as the golden machine did, else within float32 rounding (quantizers on during
    calibration would move those after the first quantized Linear by a quantization step)."""
    tensors, _ = golden
    out = _preset("NVFP4_DEFAULT_CFG", model, list(tensors["calib"].split(2)))
    found = {name.split(".input_fake_quant")[0]: m.amax for name, m in out.named_modules()
             if isinstance(m, StaticScale)}
    assert len(found) == 14
    for linear, amax in found.items():
        for config in ("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"):
            want = tensors[f"{config}.amax.{linear}.input"]
            if same_gemms:
                assert torch.equal(amax, want), (config, linear)
            else:
                torch.testing.assert_close(amax, want, rtol=1e-5, atol=0, msg=f"{config} {linear}")


@pytest.mark.parametrize("share", ["fused", "tensor"])
def test_nvfp4_weights_equal_modelopts_exported_checkpoint(golden, model, share):
    """The deployed NVFP4 weights (NVFP4QTensor: weight_scale_2 = amax/2688, E4M3 block scales
    e4m3(clamp(amax_b / (6 weight_scale_2), 2^-9, 448)), x / (scale * weight_scale_2)) against the
    preset's fake-quantized weights, bit for bit (`nvfp4_variant: "modelopt"`): with the global
    amax fused over q/k/v and gate/up as the export writes it (the preset) and with each Linear's
    own (`share_scale: "tensor"`, mtq.quantize's unfused model). The control: NVIDIA's reference
    order (`nvfp4_variant: "default"`, d = 1 / (2688 / amax)) gives other values on gate_proj's
    own scale (d one ULP off: 4810 of its 8192 elements), and -0 where ModelOpt writes +0."""
    tensors, _ = golden
    calib = list(tensors["calib"].split(2))

    def deployed(**fields) -> torch.nn.Module:
        rule = {"name": "modelopt/NVFP4_DEFAULT_CFG weights", "share_scale": share, **fields}
        return qtransform.transform(model, {"version": 1, "preset": "modelopt/NVFP4_DEFAULT_CFG", "quantize": [rule]},
                                    calibration=calib)

    out, default = deployed(), deployed(nvfp4_variant="default")
    differ = []
    for name in LAYER0:
        tag = "fused" if share == "fused" and name.rsplit(".", 1)[-1] in FUSED else "own"
        want = tensors[f"nvfp4.{tag}.{name}"]
        linear, other = out.get_submodule(name), default.get_submodule(name)
        assert torch.equal(linear.weight_fake_quant(linear.weight).view(torch.int32), want.view(torch.int32)), name
        if not torch.equal(other.weight_fake_quant(other.weight), want):
            differ.append(name)
    assert differ == (["model.layers.0.mlp.gate_proj"] if share == "tensor" else []), differ
    assert not torch.equal(tensors["nvfp4.fused.model.layers.0.self_attn.k_proj"],
                           tensors["nvfp4.own.model.layers.0.self_attn.k_proj"])  # fusing matters here


def test_mxfp8_equals_modelopts_exported_checkpoint(golden, model):
    """E8M0 scale 2^ceil(log2(amax/448)) with amax/448 rounded to fp32 (scale_rule rceil): bit
    for bit on every weight of layer 0 and on an activation spanning 6 decades."""
    tensors, _ = golden
    out = _preset("MXFP8_DEFAULT_CFG", model)
    for name in LAYER0:
        linear = out.get_submodule(name)
        assert torch.equal(linear.weight_fake_quant(linear.weight), tensors[f"mxfp8.{name}"]), name
    q_proj = out.get_submodule(LAYER0[0])
    assert torch.equal(q_proj.input_fake_quant(tensors["mxfp8.x"]), tensors["mxfp8.x_q"])


ORDERS = {"FP8_DEFAULT_CFG": ("fp8_variant", "default"),
          "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": ("int_range", "restricted")}


@pytest.mark.parametrize(("config", "moved"), [("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", 0.1), ("FP8_DEFAULT_CFG", 0.03)])
def test_logits_equal_modelopts_fake_quantized_model(golden, model, same_gemms, config, moved):
    """Where ModelOpt's fake quantization runs on CPU, its logits are the preset's, bit for bit:
    FP8 in ModelOpt's order x * (448/amax), q * (1/(448/amax)) (`fp8_variant: "modelopt"`), INT4
    as q = clamp(rne(x * (7/amax)), -8, 7), q / (7/amax) (`int_range: "modelopt"`); quantization
    itself moves them by `moved`. The control: the same rules in the division order x / (amax/448)
    (amax/7) are not ModelOpt's logits."""
    if not same_gemms:
        pytest.skip("this CPU's float32 GEMMs do not reproduce the golden machine's logits bit for "
                    "bit, and a 1-ulp difference can flip a quantization rounding")
    tensors, _ = golden
    calib = list(tensors["calib"].split(2))
    want = tensors[f"{config}.logits"]
    with torch.no_grad():
        got = _preset(config, model, calib)(input_ids=tensors["ids"]).logits
        field, other = ORDERS[config]
        rules = [{"name": f"modelopt/{config} {part}", field: other}
                 for part in (("weights", "inputs") if config == "FP8_DEFAULT_CFG" else ("weights",))]
        divided = qtransform.transform(model, {"version": 1, "preset": f"modelopt/{config}", "quantize": rules},
                                       calibration=calib)(input_ids=tensors["ids"]).logits
    assert torch.equal(got, want)
    assert not torch.equal(divided, want)
    assert (tensors["fp.logits"] - want).abs().max() > moved


def test_what_modelopt_cannot_run_on_cpu_is_recorded(golden):
    _, meta = golden
    assert meta["modelopt"] == "0.47.0"
    assert meta["FP8_DEFAULT_CFG.cpu"] == meta["INT4_BLOCKWISE_WEIGHT_ONLY_CFG.cpu"] == "runs"
    assert meta["NVFP4_DEFAULT_CFG.cpu"] == ("AssertionError: amax must be a CUDA tensor for dynamic "
                                             "block quantization.")
    assert meta["MXFP8_DEFAULT_CFG.cpu"] == ("RuntimeError: Skipping extension modelopt_cuda_ext_mx "
                                             "because CUDA is not available.")


def test_presets_expand_and_user_fields_override():
    policy = load_policy({"version": 1, "preset": "modelopt/INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
                          "quantize": [{"name": "modelopt/INT4_BLOCKWISE_WEIGHT_ONLY_CFG weights",
                                        "block_size": 64}]})
    (rule,) = policy.quantize
    assert (rule.format, rule.block_size, rule.tensors) == ("int4", 64, ["weight"])
    assert rule.ignore == IGNORE


# -- batch invariance ---------------------------------------------------------------------------
CONFIGS = ("NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG", "MXFP8_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG")


@pytest.fixture(scope="module")
def deployed(golden, model) -> dict[str, torch.nn.Module]:
    calib = list(golden[0]["calib"].split(2))
    return {name: _preset(name, model, calib) for name in CONFIGS}


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=32, max_size=32), st.sampled_from(CONFIGS))
def test_a_sequences_logits_never_depend_on_its_batch(deployed, tokens, config):
    """Static (calibrated) tensor scales and per-block dynamic ones: what a deployed ModelOpt
    checkpoint computes for a sequence is the same alone or beside any other sequences."""
    ids = torch.cat([torch.arange(16)[None], torch.tensor(tokens).reshape(2, 16)])
    out = deployed[config]
    with torch.no_grad():
        assert torch.equal(out(input_ids=ids[:1]).logits, out(input_ids=ids).logits[:1])


def test_the_batch_check_fails_for_a_per_call_global_scale(model):
    """The control: NVFP4 inputs with the whole call's amax as global scale (not ModelOpt's)."""
    per_call = {"version": 1, "preset": "modelopt/NVFP4_DEFAULT_CFG",
                "quantize": [{"name": "modelopt/NVFP4_DEFAULT_CFG inputs", "scale_source": "dynamic",
                              "observer": None, "global_scale": "tensor"}]}
    out = qtransform.transform(model, per_call)
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert not torch.equal(out(input_ids=ids[:1]).logits, out(input_ids=ids).logits[:1])


def test_nvfp4_preset_exports_to_onnx(golden, model, tmp_path):
    """ModelOpt's order in the ONNX function bodies too: the exported NVFP4_DEFAULT_CFG model (the
    calibrated input amax and the fused weight amax constants of their fake-quant nodes) gives the
    preset's logits."""
    import onnx
    import onnxruntime as ort

    tensors, _ = golden
    out = _preset("NVFP4_DEFAULT_CFG", model, list(tensors["calib"].split(2)))
    ids = tensors["ids"]
    path = qtransform.export_onnx(out, tmp_path / "m.onnx", {"input_ids": ids})
    nodes = [n for n in onnx.load(path).graph.node if n.op_type == "NVFP4FakeQuant"]
    assert len(nodes) == 28  # 14 Linears, weight and input
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["nvfp4_variant"] == b"modelopt", node.name
        fused = node.name.split("/")[0].rsplit(".", 1)[-1] in FUSED
        assert ("global_amax" in attrs) == (node.name.endswith("input_fake_quant") or fused), node.name
    got = ort.InferenceSession(str(path)).run(None, {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        want = out(input_ids=ids).logits
    assert (torch.from_numpy(got) - want).abs().max() < 1e-5
