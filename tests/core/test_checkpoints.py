"""Quantized checkpoints opened back: folders packed here by hand in the
compressed-tensors and ModelOpt layouts from qtransform's own encoded tensors
(`formats.encode`), so the reader's unpacking is checked against an independent encoder, bit
for bit; and every layout it does not know is refused with an error that names it.
tests_llmc/test_checkpoints.py checks the same reader against llm-compressor's own folders."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import qtransform
from qtransform.errors import UserError
from qtransform.formats import encode
from qtransform.formats.elements import decode_elements
from qtransform.models import build_tiny, checkpoint_policy, load_model

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def ct_config(fmt: str, weights: dict, inputs: dict | None = None, ignore=("lm_head",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": list(ignore), "config_groups": {"group_0": {
                "targets": ["Linear"], "format": fmt, "weights": weights,
                "input_activations": inputs, "output_activations": None}}}


def args(kind, bits, strategy, group_size=None, dynamic=False, block=None):
    return {"type": kind, "num_bits": bits, "strategy": strategy, "group_size": group_size,
            "dynamic": dynamic, "symmetric": True, "block_structure": block, "actorder": None}


def write_folder(tmp_path, model, pack, quantization_config=None, modelopt=None):
    """`model` saved, then each Linear's weight replaced by `pack(name, weight)`'s tensors."""
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    expected = {}
    for name in list(state):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS:
            tensors, value = pack(module, state.pop(name))
            state.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            expected[name] = value
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    if modelopt is not None:
        (folder / "hf_quant_config.json").write_text(json.dumps(modelopt))
    return folder, expected


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte, the even element in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def int32_words(values: np.ndarray, bits: int) -> torch.Tensor:
    """Signed ints offset by 2^(bits-1), element i at bit i*bits of each row's little-endian
    stream of int32 words (compressed-tensors' pack_to_int32), written with numpy's bit tools."""
    unsigned = (values.astype(np.int64) + (1 << (bits - 1))).astype(np.uint8)
    bitstream = np.unpackbits(unsigned[..., None], axis=-1, bitorder="little")[..., :bits]
    rows = bitstream.reshape(values.shape[0], -1)
    pad = (-rows.shape[1]) % 32
    rows = np.pad(rows, ((0, 0), (0, pad)))
    packed = np.packbits(rows, axis=-1, bitorder="little")
    return torch.from_numpy(packed.view("<i4").copy())


def check(folder, expected):
    model = load_model(folder)
    state = model.state_dict()
    for name, value in expected.items():
        assert state[name].dtype == value.dtype
        assert torch.equal(state[name], value), name
    return model


@pytest.fixture
def tiny_bf16():
    return build_tiny("qwen2", hidden=64, dtype=torch.bfloat16)


def test_nvfp4_pack_quantized_equals_our_encoding(tmp_path, tiny_bf16):
    def pack(module, w):
        enc = encode(w, "nvfp4", nvfp4_variant="compressed-tensors")
        codes = enc.codes.reshape(w.shape)
        return ({"weight_packed": nibbles(codes),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1).to(torch.float8_e4m3fn),
                 "weight_global_scale": enc.tensor_scale.reshape(1)}, encode_decode(enc))
    nv = args("float", 4, "tensor_group", 16)
    folder, expected = write_folder(tmp_path, tiny_bf16, pack, ct_config("nvfp4-pack-quantized", nv))
    model = check(folder, expected)
    assert checkpoint_policy(model) == {"version": 1, "quantize": []}  # weights only: nothing left
    assert not hasattr(model.config, "quantization_config")


def encode_decode(enc):
    from qtransform.formats import decode

    return decode(enc)


def test_mxfp4_with_e8m0_exponents_equals_our_encoding(tmp_path, tiny_bf16):
    def pack(module, w):
        enc = encode(w, "mxfp4", scale_rule="even")
        return ({"weight_packed": nibbles(enc.codes.reshape(w.shape)),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1).to(torch.uint8)}, encode_decode(enc))
    mx = args("float", 4, "group", 32)
    folder, expected = write_folder(tmp_path, tiny_bf16, pack,
                                    ct_config("mxfp4-pack-quantized", mx, args("float", 4, "group", 32, True)))
    model = check(folder, expected)
    rules = checkpoint_policy(model)["quantize"]
    assert [(r["format"], r["scale_rule"], r["tensors"], r["ignore"]) for r in rules] == [
        ("mxfp4", "even", ["input"], ["re:lm_head"])]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_quantized_ints_equal_our_encoding(tmp_path, bits):
    model = build_tiny("qwen2", hidden=64)
    def pack(module, w):
        enc = encode(w, f"int{bits}", block_size=32)
        q = enc.signed_codes().reshape(w.shape)
        return ({"weight_packed": int32_words(q.numpy(), bits),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1),
                 "weight_shape": torch.tensor(list(w.shape))}, encode_decode(enc))
    folder, expected = write_folder(tmp_path, model, pack,
                                    ct_config("pack-quantized", args("int", bits, "group", 32)))
    check(folder, expected)


def test_int8_channels_and_fp8_blocks_equal_our_encoding(tmp_path):
    model = build_tiny("qwen2", hidden=64)
    def int8(module, w):
        enc = encode(w, "int8", granularity="channel")
        return ({"weight": enc.signed_codes().reshape(w.shape),
                 "weight_scale": enc.scales.reshape(-1, 1)}, encode_decode(enc))
    folder, expected = write_folder(tmp_path, model, int8,
                                    ct_config("int-quantized", args("int", 8, "channel")))
    check(folder, expected)

    def fp8(module, w):
        enc = encode(w, "fp8_e4m3", granularity="tile", block_shape=(32, 32))
        q = decode_elements(enc.codes, enc.config.spec.element)
        return ({"weight": _tiles_back(q, enc).to(torch.float8_e4m3fn),
                 "weight_scale": enc.scale_grid().reshape(w.shape[0] // 32, w.shape[1] // 32)},
                encode_decode(enc))
    (tmp_path / "b").mkdir()
    folder, expected = write_folder(tmp_path / "b", model, fp8,
                                    ct_config("float-quantized", args("float", 8, "block", block=[32, 32])))
    check(folder, expected)


def _tiles_back(q, enc):
    from qtransform.formats.blocking import from_blocks

    return from_blocks(q, enc.layout).reshape(enc.shape)


def test_modelopt_nvfp4_and_fp8_equal_our_encoding(tmp_path):
    model = build_tiny("qwen2", hidden=64)
    def nvfp4(module, w):
        enc = encode(w, "nvfp4", nvfp4_variant="modelopt")
        return ({"weight": nibbles(enc.codes.reshape(w.shape)),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1).to(torch.float8_e4m3fn),
                 "weight_scale_2": enc.tensor_scale.reshape(()),
                 "input_scale": torch.tensor(0.5 / 2688)}, encode_decode(enc))
    hf = {"producer": {"name": "modelopt", "version": "0.47.0"},
          "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                           "exclude_modules": ["lm_head", "*vision_tower*"]}}
    folder, expected = write_folder(tmp_path, model, nvfp4, modelopt=hf)
    opened = check(folder, expected)
    [rule] = checkpoint_policy(opened)["quantize"]
    assert (rule["format"], rule["nvfp4_variant"], rule["scale_source"]) == ("nvfp4", "modelopt", "static")
    assert rule["ignore"] == ["re:(?:(?s:lm_head)\\Z)"]  # the entry naming no module is left out
    # the stored input scale d = amax/2688 is the static scale as stored (no amax made of it)
    t = qtransform.transform(opened, checkpoint_policy(opened))
    scales = [m for m in t.modules() if type(m).__name__ == "StaticScale"]
    assert len(scales) == 14 and all(m.stored and m.amax.isnan() for m in scales)
    assert {m.scale.item() for m in scales} == {torch.tensor(0.5 / 2688).item()}

    def fp8(module, w):
        enc = encode(w, "fp8_e4m3", granularity="tensor", fp8_variant="modelopt")
        q = decode_elements(enc.codes, enc.config.spec.element).reshape(w.shape)
        return ({"weight": q.to(torch.float8_e4m3fn), "weight_scale": enc.scales.unique().reshape(()),
                 "input_scale": torch.tensor(0.25)}, encode_decode(enc))
    hf["quantization"] = {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    (tmp_path / "b").mkdir()
    folder, expected = write_folder(tmp_path / "b", model, fp8, modelopt=hf)
    opened = check(folder, expected)
    [rule] = checkpoint_policy(opened)["quantize"]
    assert (rule["format"], rule["fp8_variant"], rule["granularity"]) == ("fp8_e4m3", "modelopt", "tensor")


def test_opened_checkpoint_runs_through_the_cli_plan(tmp_path, tiny_bf16):
    def pack(module, w):
        enc = encode(w, "mxfp4", scale_rule="even")
        return ({"weight_packed": nibbles(enc.codes.reshape(w.shape)),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1).to(torch.uint8)}, encode_decode(enc))
    folder, _ = write_folder(tmp_path, tiny_bf16, pack, ct_config(
        "mxfp4-pack-quantized", args("float", 4, "group", 32), args("float", 4, "group", 32, True)))
    out = subprocess.run([sys.executable, "-m", "qtransform.cli.main", "plan", str(folder)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "compressed-tensors checkpoint: weights mxfp4, activations mxfp4" in out.stdout
    assert "14 quantized modules; kept in high precision: lm_head" in out.stdout


@pytest.mark.parametrize(("change", "message"), [
    (lambda q: q.update(quant_method="gptq"), "a 'gptq' quantized checkpoint"),
    (lambda q: q.update(format="marlin-24") or q["config_groups"]["group_0"].update(format="marlin-24"),
     "format 'marlin-24'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), "3-bit int elements"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "actorder 'group'"),
    (lambda q: q.update(transform_config={"config_groups": {"u": {}}}), "transform_config"),
    (lambda q: q.update(quantization_status="initialized"), "quantization_status 'initialized'"),
])
def test_unknown_layouts_are_refused_naming_them(tmp_path, change, message):
    model = build_tiny("qwen2", hidden=64)
    def int8(module, w):
        enc = encode(w, "int8", granularity="channel")
        return ({"weight": enc.signed_codes().reshape(w.shape),
                 "weight_scale": enc.scales.reshape(-1, 1)}, encode_decode(enc))
    q = ct_config("int-quantized", args("int", 8, "channel"))
    change(q)
    folder, _ = write_folder(tmp_path, model, int8, q)
    with pytest.raises(UserError, match=message):
        load_model(folder)


def test_modelopt_algorithms_it_cannot_read_are_refused(tmp_path):
    model = build_tiny("qwen2", hidden=64)
    folder, _ = write_folder(tmp_path, model, lambda m, w: ({"weight": w}, w),
                             modelopt={"quantization": {"quant_algo": "W4A8_AWQ"}})
    with pytest.raises(UserError, match="quant_algo 'W4A8_AWQ'.*reads NVFP4, W4A16_NVFP4, FP8"):
        load_model(folder)


def test_a_missing_or_misshapen_scale_is_an_error_naming_the_module(tmp_path):
    model = build_tiny("qwen2", hidden=64)
    def bad(module, w):
        return ({"weight": w.to(torch.int8), "weight_scale": torch.ones(3, 1)}, w)
    folder, _ = write_folder(tmp_path, model, bad, ct_config("int-quantized", args("int", 8, "channel")))
    with pytest.raises(UserError, match=r"down_proj \(int-quantized\): weight_scale of shape "
                       r"\[3, 1\] does not fit int8 per channel on a \[64, 128\] weight"):
        load_model(folder)
    (tmp_path / "b").mkdir()
    folder, _ = write_folder(tmp_path / "b", model, lambda m, w: ({"weight_scale": torch.ones(1),
                                                       "weight_shape": torch.tensor(list(w.shape))}, w),
                             ct_config("pack-quantized", args("int", 4, "channel")))
    with pytest.raises(UserError, match=r"\(pack-quantized\): no weight_packed tensor"):
        load_model(folder)


def test_a_plain_model_has_no_checkpoint_policy():
    assert checkpoint_policy(build_tiny("qwen2")) is None


def test_asymmetric_int4_with_packed_zero_points(tmp_path):
    """Zero points are packed along the output axis (compressed-tensors' packed_dim 0); the
    weights open, and the policy refuses to describe asymmetric integers."""
    model = build_tiny("qwen2", hidden=64)
    g = torch.Generator().manual_seed(0)

    def pack(module, w):
        rows, cols = w.shape
        q = torch.randint(-8, 8, (rows, cols), generator=g)
        zp = torch.randint(-8, 8, (rows, cols // 32), generator=g)
        scale = torch.rand(rows, cols // 32, generator=g) + 0.01
        value = ((q - zp.repeat_interleave(32, dim=1)).float()
                 * scale.repeat_interleave(32, dim=1)).to(w.dtype)
        return ({"weight_packed": int32_words(q.numpy(), 4), "weight_scale": scale,
                 "weight_zero_point": int32_words(zp.t().numpy(), 4).t(),
                 "weight_shape": torch.tensor([rows, cols])}, value)
    weights = {**args("int", 4, "group", 32), "symmetric": False}
    folder, expected = write_folder(tmp_path, model, pack, ct_config(
        "pack-quantized", weights, {**args("int", 8, "token", dynamic=True), "symmetric": False}))
    opened = check(folder, expected)
    with pytest.raises(UserError, match="asymmetric integers"):
        checkpoint_policy(opened)


def test_cli_transform_and_scan_a_checkpoint_without_a_policy(tmp_path, tiny_bf16):
    def pack(module, w):
        enc = encode(w, "nvfp4", nvfp4_variant="compressed-tensors")
        return ({"weight_packed": nibbles(enc.codes.reshape(w.shape)),
                 "weight_scale": enc.scales.reshape(w.shape[0], -1).to(torch.float8_e4m3fn),
                 "weight_global_scale": enc.tensor_scale.reshape(1),
                 "input_global_scale": torch.tensor([448.0])}, encode_decode(enc))
    nv = args("float", 4, "tensor_group", 16)
    folder, _ = write_folder(tmp_path, tiny_bf16, pack, ct_config(
        "nvfp4-pack-quantized", nv, {**nv, "dynamic": "local"}))
    cli = [sys.executable, "-m", "qtransform.cli.main"]
    out = subprocess.run([*cli, "transform", str(folder), "--out", str(tmp_path / "t")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    saved = qtransform.load_transformed(tmp_path / "t")
    scales = [m for m in saved.modules() if type(m).__name__ == "StaticScale"]
    assert {(m.stored, m.scale.item()) for m in scales} == {(True, 448.0)}  # g, saved as stored
    out = subprocess.run([*cli, "scan", str(folder), "--format", "mxfp4", "--out", str(tmp_path / "s"),
                          "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("weights of 14 sites already on an nvfp4 (E2M1 per 16) grid: re-quantizing stacks two "
            "roundings") in out.stdout
    plain = tmp_path / "plain"
    tiny_bf16.save_pretrained(plain)
    out = subprocess.run([*cli, "plan", str(plain)], capture_output=True, text=True)
    assert out.returncode == 2 and "no policy given, and the model is not a quantized checkpoint" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("entry", ["lm_head", "Linear", "re:.*mlp.gate", "model.layers.0.mlp.down_proj",
                                   "re:model\\.layers\\.[0-9]+\\.self_attn.*", "mlp.gate_proj"])
def test_selector_entries_select_what_compressed_tensors_matches(entry):
    """The one translation (presets, reader and writer use it) selects exactly the modules
    compressed-tensors' own matching takes, on a real model's module names."""
    from types import SimpleNamespace

    from qtransform.checkpoints.matching import ct_entry, ct_matches
    from qtransform.schemas.selectors import compile_entry

    compiled = compile_entry(ct_entry(entry))
    linears = [n for n, m in build_tiny("qwen2").named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    for name in linears:
        site = SimpleNamespace(name=name, cls_name="Linear", kind="linear", layer=None)
        assert compiled.matches(site) == ct_matches(entry, name, "Linear"), (entry, name)
