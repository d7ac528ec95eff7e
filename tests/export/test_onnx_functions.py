"""ONNX function bodies: bit-exact in onnxruntime against qtransform.formats.fake_quantize.

Every format and option runs as one fake-quant node in a single model (one onnxruntime session),
on random rows with a random scale per row plus adversarial values: every power of two and its
neighbours (exact exponents), subnormals, ties, signed zeros, NaN and Inf, ragged rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from qtransform import fake_quantize, formats
from qtransform.export.functions import (
    DOMAIN,
    Shape,
    UnsupportedExport,
    attributes,
    fake_quant_function,
    overload,
    static_blocks,
)
from qtransform.export.onnx import ExportError
from qtransform.formats import QuantConfig


def all_configs() -> list[tuple[str, dict]]:
    """Every registered format with every deterministic scale rule / rounding / variant, plus
    non-default blocking (axis 0, 2D tiles, an odd int group)."""
    out = []
    for fmt in formats.names():
        spec = formats.get(fmt)
        rules = spec.options.get("scale_rule", (None,))
        variants = [v for v in spec.options.get("nvfp4_variant", (None,)) if v != "quartet-ii"]  # no body
        for rule, rounding, variant in itertools.product(rules, ("rne", "rna"), variants):
            opts = {"rounding": rounding}
            opts |= {"scale_rule": rule} if rule else {}
            opts |= {"nvfp4_variant": variant} if variant else {}
            out.append((fmt, opts))
        out.append((fmt, {"axis": 0}))
        out.append((fmt, {"block_shape": (16, 32) if spec.family == "int" else spec.tile}))
    out.append(("int4", {"block_size": 24}))
    return out


def adversarial(rows: int = 48, cols: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-24, 24, (rows, 1), generator=g).float())
    p = torch.exp2(torch.arange(-149, 128).float())
    special = torch.cat([
        p, torch.nextafter(p, torch.tensor(0.0)), torch.nextafter(p, torch.tensor(float("inf"))),
        torch.tensor([0.0, -0.0, 6.25, 7.5, 5.0, 3.5, 2.5, 0.25, 0.75, 1.25, 7.9999995, 1e-40,
                      3.4e38, float("nan"), float("inf"), -float("inf")]),
    ])
    special = special * torch.where(torch.rand(special.numel(), generator=g) < 0.5, -1.0, 1.0)
    flat = x.flatten()
    flat[torch.randperm(flat.numel(), generator=g)[: special.numel()]] = special
    x = flat.reshape(rows, cols)
    x[0] = 0.0  # an all-zero row
    x[1, :16] = -0.0
    x[2] *= 1e-38  # a row of (mostly) subnormals
    return x


def model_for(configs: list[QuantConfig], shape: list, elem_type: int = TensorProto.FLOAT,
              static: Shape = None) -> onnx.ModelProto:
    """One input, one fake-quant node and output per config, functions attached (bodies with
    constant block shapes for the `static` input shape)."""
    nodes, outputs, functions = [], [], {}
    for i, cfg in enumerate(configs):
        node = helper.make_node(cfg.spec.onnx_op, ["x"], [f"y{i}"], domain=DOMAIN, name=f"fq{i}",
                                **attributes(cfg))
        node.overload = overload(cfg, static)
        nodes.append(node)
        outputs.append(helper.make_tensor_value_info(f"y{i}", elem_type, shape))
        functions.setdefault((cfg.spec.onnx_op, node.overload), fake_quant_function(cfg, 21, static))
    graph = helper.make_graph(nodes, "fq", [helper.make_tensor_value_info("x", elem_type, shape)], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)],
                              functions=list(functions.values()), ir_version=10)
    onnx.checker.check_model(model)
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose bits differ (any NaN equals any NaN: payloads are not part of the contract)."""
    assert got.dtype == want.dtype
    ints = torch.int32 if got.dtype == torch.float32 else torch.int16
    both_nan = torch.isnan(got) & torch.isnan(want)
    return int((~((got.view(ints) == want.view(ints)) | both_nan)).sum())


def check(cases: list[tuple[str, dict]], x: torch.Tensor, *, static: bool, elem_type: int = TensorProto.FLOAT):
    """Run every case as one node of one model; assert all outputs equal fake_quantize bit for bit."""
    shape = tuple(x.shape) if static else None
    configs = [QuantConfig.from_options(f, o).bind(-1) for f, o in cases]
    assert all(static_blocks(c, shape) == static for c in configs)
    dims = list(x.shape) if static else [f"d{i}" for i in range(x.dim())]
    outs = run(model_for(configs, dims, elem_type, shape), x.numpy())
    failures = []
    for (fmt, opts), got in zip(cases, outs, strict=True):
        bad = bit_mismatches(torch.from_numpy(got), fake_quantize(x, fmt, **opts))
        if bad:
            failures.append(f"{fmt} {opts}: {bad} elements differ")
    assert not failures, "\n".join(failures)


def granularity_configs() -> list[tuple[str, dict]]:
    """The plain-scale families at every granularity and integer convention."""
    out = []
    for fmt in ("fp8_e4m3", "fp8_e5m2", "int4", "int8"):
        ranges = (("restricted", "full", "modelopt", "vllm-per-token-head") if fmt.startswith("int")
                  else (None,))
        for g, r, rounding in itertools.product(("channel", "token", "tensor", "block"), ranges, ("rne", "rna")):
            opts = {"granularity": g, "rounding": rounding} if g != "block" else {"block_size": 24, "rounding": rounding}
            out.append((fmt, opts | ({"int_range": r} if r else {})))
        out.append((fmt, {"block_shape": (16, 40)}))
        out.append((fmt, {"granularity": "channel", "axis": 0}))
        if fmt.startswith("fp8"):
            out += [(fmt, {"granularity": g, "fp8_variant": v}) for g in ("tensor", "channel", "token")
                    for v in ("modelopt", "vllm-per-token-head")]
    return out


@pytest.mark.parametrize("static", [True, False])
def test_granularities_and_plain_scale_formats_are_bit_exact(static):
    check(granularity_configs(), adversarial(), static=static)
    x3 = adversarial(32, 200, seed=6).reshape(4, 8, 200)
    check([("fp8_e4m3", {"granularity": "token"}), ("int8", {"granularity": "tensor", "int_range": "full"}),
           ("fp8_e5m2", {"granularity": "channel", "axis": 1})], x3, static=static)


def test_scale_dtype_other_than_fp32_is_refused_in_one_line():
    from qtransform.export.onnx import _fake_quant_translation

    with pytest.raises(ExportError, match=r"^fake-quant 'l/weight_fake_quant' \(fp8_e4m3\): scale_dtype "
                       r"'bfloat16' has no ONNX body; export the model in float32 or with scale_dtype "
                       r"'float32'$"):
        _fake_quant_translation(None, "fp8_e4m3", '{"scale_dtype": "bfloat16"}', "l/weight_fake_quant")


def test_an_nvfp4_variant_without_a_body_is_refused_not_computed_otherwise():
    with pytest.raises(UnsupportedExport, match=r"^nvfp4: nvfp4_variant 'quartet-ii' has no ONNX body"):
        fake_quant_function(QuantConfig.from_options("nvfp4", {"nvfp4_variant": "quartet-ii"}).bind(-1), 21, None)


def test_every_format_and_option_is_bit_exact_in_onnxruntime():
    cases = all_configs()
    assert len(cases) >= 60
    check(cases, adversarial(), static=True)


@pytest.mark.parametrize("static", [True, False])
def test_four_over_six_is_bit_exact_in_onnxruntime(static):
    """Both error modes and bounds, rounding rne/rna, blocks along either axis, a short axis
    (block cut to 6 elements, padded for the error's halving) and fp16 inputs."""
    cases = [("nvfp4", {"four_over_six": m, "rounding": r}) for m in ("mse", "mae") for r in ("rne", "rna")]
    cases += [("nvfp4", {"four_over_six": "mae", "global_bound": 256}), ("nvfp4", {"global_bound": 256}),
              ("nvfp4", {"four_over_six": "mse", "axis": 0}), ("nvfp4", {"four_over_six": "mse", "block_size": 32})]
    check(cases, adversarial(), static=static)
    short = torch.randn(40, 6, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 2, 40)[:, None]
    check([("nvfp4", {"four_over_six": "mse"})], short, static=static)
    xh = adversarial(seed=4).to(torch.float16)
    check([("nvfp4", {"four_over_six": "mae"})], xh, static=static, elem_type=TensorProto.FLOAT16)


def test_dynamic_shapes_block_the_same_way():
    """Bodies of inputs with symbolic dims cut blocks from Shape(x) at run time."""
    cases = [("mxfp4", {}), ("mxfp8_e4m3", {"axis": 0}), ("nvfp4", {}), ("nvfp4", {"nvfp4_variant": "one_level"}),
             ("int4", {"block_size": 24}), ("mxfp6_e3m2", {"block_shape": (32, 32)}),
             ("nvfp4", {"block_shape": (16, 16), "nvfp4_variant": "compressed-tensors"})]
    check(cases, adversarial(seed=3), static=False)


@pytest.mark.parametrize("static", [True, False])
def test_other_ranks_and_axes(static):
    x3 = adversarial(32, 200, seed=1).reshape(4, 8, 200)
    cases = [("mxfp4", {}), ("mxfp4", {"axis": 1}), ("nvfp4", {"axis": 0}), ("int8", {"axis": -2}),
             ("mxfp8_e5m2", {"block_shape": (32, 32)})]
    check(cases, x3, static=static)


def test_half_precision_inputs_round_at_the_end():
    xh = torch.nan_to_num(adversarial(seed=2), posinf=0.0, neginf=0.0).clamp(-6e4, 6e4).half()
    check([("mxfp4", {}), ("nvfp4", {}), ("int4", {})], xh, static=True, elem_type=TensorProto.FLOAT16)


def test_node_attributes_and_overloads_name_the_options():
    cfg = QuantConfig.from_options("mxfp4", {"scale_rule": "rceil", "axis": 0})
    assert cfg.spec.onnx_op == "MXFP4FakeQuant"
    assert attributes(cfg) == {"axis": 0, "rounding": "rne", "block_size": 32, "scale_rule": "rceil"}
    assert overload(cfg) == "b32_axis0_rne_rceil"
    assert overload(cfg, (4, 64)) == "b32_axis0_rne_rceil_s4x64" and overload(cfg, (None, 64)) == overload(cfg)
    tiles = QuantConfig.from_options("nvfp4", {"block_shape": [16, 16], "nvfp4_variant": "one_level"})
    assert attributes(tiles)["block_shape"] == [16, 16] and overload(tiles) == "b16x16_axism1_rne_one_level"
    assert attributes(QuantConfig.from_options("int4", {})) == {
        "axis": -1, "rounding": "rne", "block_size": 128, "int_range": "restricted", "scale_dtype": "float32"}
    per_row = QuantConfig.from_options("int8", {"granularity": "channel", "int_range": "full"})
    assert attributes(per_row) == {"granularity": "channel", "axis": -1, "rounding": "rne",
                                   "int_range": "full", "scale_dtype": "float32"}
    assert overload(per_row) == "bchannel_axism1_rne_full_float32"
    fn = fake_quant_function(cfg, 21)
    assert (fn.domain, fn.name, fn.overload) == (DOMAIN, "MXFP4FakeQuant", overload(cfg))
    assert all(n.domain == "" for n in fn.node)  # standard ops only


def test_stochastic_rounding_and_bad_options_are_clear_errors():
    from qtransform.export.onnx import _fake_quant_translation

    with pytest.raises(ExportError, match="layer/weight_fake_quant.*stochastic rounding cannot be exported"):
        _fake_quant_translation(None, "mxfp4", '{"rounding": "stochastic"}', "layer/weight_fake_quant")
    with pytest.raises(ExportError, match="scale_rule='flor'.*did you mean 'floor'"):
        _fake_quant_translation(None, "mxfp4", '{"scale_rule": "flor"}', "layer/weight_fake_quant")


# the formats' default blocks and tiles on dims shorter than them (a configured block longer
# than its axis is an error: tests/formats/test_formats_granularity.py)
BLOCKS_LONGER_THAN_ROWS = [("int8", {}), ("int4", {"axis": 0}), ("mxfp8_e4m3", {"axis": 0}),
                           ("int4", {"block_shape": (128, 128)}),
                           ("fp8_e4m3", {})]


def padded_sizes(model: onnx.ModelProto, x: np.ndarray) -> list[int]:
    """The element count of every Pad output when `model` runs on x (functions inlined, each Pad's
    output made a graph output)."""
    flat = onnx.inliner.inline_local_functions(model)
    pads = [n.output[0] for n in flat.graph.node if n.op_type == "Pad"]
    flat.graph.output.extend(helper.make_tensor_value_info(p, TensorProto.FLOAT, None) for p in pads)
    session = ort.InferenceSession(flat.SerializeToString(), providers=["CPUExecutionProvider"])
    return [int(v.size) for v in session.run(pads, {"x": x})]


@pytest.mark.parametrize("static", [True, False])
def test_a_block_longer_than_its_row_is_cut_to_the_row_as_in_torch(static):
    """The torch path cuts a format's default block (or tile side) longer than its dim to the
    dim (`blocking.make_layout`); the bodies do the same, so they give the same bits without
    padding every row to the block (a group of 10^5 made a Pad 2500 times the tensor)."""
    x = adversarial(24, 40, seed=4)
    check(BLOCKS_LONGER_THAN_ROWS, x, static=static)
    shape = tuple(x.shape) if static else None
    dims = list(x.shape) if static else ["rows", "cols"]
    for fmt, opts in BLOCKS_LONGER_THAN_ROWS:
        model = model_for([QuantConfig.from_options(fmt, opts).bind(-1)], dims, static=shape)
        assert all(size <= x.numel() for size in padded_sizes(model, x.numpy())), (fmt, opts)
    ragged = adversarial(24, 40, seed=5)[:, :37]  # 37 = 32 + 5: one full MX block and a short one
    model = model_for([QuantConfig.from_options("mxfp4", {}).bind(-1)], ["rows", "cols"])
    assert padded_sizes(model, ragged.numpy()) == [24 * 64]
