"""export_checkpoint's compressed-tensors folders, read back with our own decoding (the main
environment has no compressed-tensors; tests_llmc/test_checkpoint.py compares the bytes with
llm-compressor's own and loads them in transformers): every quantized weight decodes to the
fake-quant model's weight bit for bit, the config carries the scheme, the noise is left out,
LoRA is merged then quantized, and the caller's model is untouched."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import qtransform
from qtransform.models import build_tiny
from tests.helpers import assert_untouched, snapshot

HIDDEN = 128  # llm-compressor's int4 groups and FP8 activation groups are 128 wide
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SCHEMES = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4A16", "W8A8"]


def calibration(vocab: int = 256) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(2)]


def read(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


# -- an independent decoder of the compressed-tensors layout (its `dequantize`, written from the
# -- layout description in docs/export.md, not from the writer's code)
def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).long()
    mag = E2M1[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def int_values(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    words = packed.long() & 0xFFFFFFFF
    stream = [(int(w) >> b) & 1 for row in words for w in row for b in range(32)]
    per_row = words.shape[1] * 32
    rows = []
    for r in range(words.shape[0]):
        bitsrow = stream[r * per_row:(r + 1) * per_row]
        rows.append([sum(bitsrow[i * bits + b] << b for b in range(bits)) - (1 << (bits - 1))
                     for i in range(cols)])
    return torch.tensor(rows, dtype=torch.float32)


def expand(scale: torch.Tensor, shape: tuple[int, int], tile: tuple[int, int] | None = None) -> torch.Tensor:
    rows, cols = shape
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, cols)
    if tile is not None:
        return scale.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[:rows, :cols]
    return scale.repeat_interleave(cols // scale.shape[1], 1)


def decode(tensors: dict[str, torch.Tensor], name: str, args: dict, dtype: torch.dtype) -> torch.Tensor:
    t = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
    if "weight_global_scale" in t:  # NVFP4: q * (scale / global scale) in fp32
        scale = t["weight_scale"].float() / t["weight_global_scale"]
        q = fp4_values(t["weight_packed"])
        return (q * expand(scale, q.shape)).to(dtype)
    if args["num_bits"] == 4 and args["type"] == "float":  # MXFP4: q * 2^(e - 127)
        q = fp4_values(t["weight_packed"])
        return (q * expand(torch.exp2(t["weight_scale"].float() - 127), q.shape)).to(dtype)
    if "weight_packed" in t:  # pack-quantized ints
        rows, cols = t["weight_shape"].tolist()
        q = int_values(t["weight_packed"], args["num_bits"], cols)
    else:
        q = t["weight"].float()
    scale = t["weight_scale"]
    tile = tuple(args["block_structure"]) if args["block_structure"] else None
    return (q.to(scale.dtype) * expand(scale, tuple(q.shape), tile)).to(dtype)


def exported(scheme: str, tmp_path, dtype=torch.float32, arch="qwen2"):
    model = build_tiny(arch, hidden=HIDDEN, dtype=dtype)
    ours = qtransform.transform(model, {"preset": f"llm-compressor/{scheme}"}, calibration=calibration())
    qtransform.export_checkpoint(ours, tmp_path / "out")
    return ours, read(tmp_path / "out"), json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_weight_decodes_to_the_fake_quant_weight(scheme, dtype, tmp_path):
    ours, tensors, config = exported(scheme, tmp_path, dtype)
    qc = config["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and qc["ignore"] == ["lm_head"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    checked = 0
    for name, module in ours.named_modules():
        fq = getattr(module, "weight_fake_quant", None)
        if fq is None:
            continue
        got = decode(tensors, name, group["weights"], dtype)
        assert torch.equal(got, fq.quantized_copy(module.weight)), name
        assert f"{name}.weight" not in tensors or tensors[f"{name}.weight"].dtype in (
            torch.float8_e4m3fn, torch.int8)
        checked += 1
    assert checked == 14
    assert torch.equal(tensors["lm_head.weight"], ours.lm_head.weight)  # high precision, as is
    assert tensors["model.norm.weight"].dtype == dtype


EXPECTED_ARGS = {  # compressed-tensors' PRESET_SCHEMES, as llm-compressor records them
    "NVFP4": ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                       "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"},
              {"strategy": "tensor_group", "dynamic": "local", "observer": "static_minmax"}),
    "MXFP4": ("mxfp4-pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32,
                                       "scale_dtype": "torch.uint8"},
              {"strategy": "group", "group_size": 32, "dynamic": True}),
    "FP8": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor"},
            {"strategy": "tensor", "dynamic": False, "observer": "static_minmax"}),
    "FP8_DYNAMIC": ("float-quantized", {"strategy": "channel"}, {"strategy": "token", "dynamic": True}),
    "FP8_BLOCK": ("float-quantized", {"strategy": "block", "block_structure": [128, 128]},
                  {"strategy": "group", "group_size": 128, "dynamic": True}),
    "W4A16": ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, None),
    "W8A8": ("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel"},
             {"strategy": "token", "type": "int", "dynamic": True}),
}


@pytest.mark.parametrize("scheme", sorted(EXPECTED_ARGS))
def test_the_config_carries_the_scheme(scheme, tmp_path):
    _, tensors, config = exported(scheme, tmp_path)
    fmt, weights, inputs = EXPECTED_ARGS[scheme]
    qc = config["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert qc["format"] == group["format"] == fmt
    assert weights.items() <= group["weights"].items()
    assert group["weights"]["symmetric"] and group["weights"]["observer"] == "memoryless_minmax"
    if inputs is None:
        assert group["input_activations"] is None
    else:
        assert inputs.items() <= group["input_activations"].items()
    static = "input_global_scale" if scheme == "NVFP4" else "input_scale"
    assert (f"model.layers.0.mlp.up_proj.{static}" in tensors) == (scheme in ("NVFP4", "FP8"))
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "float32"


def test_static_input_scales_are_the_calibrated_ones(tmp_path):
    ours, tensors, _ = exported("NVFP4", tmp_path)
    for name, module in ours.named_modules():
        fq = getattr(module, "input_fake_quant", None)
        if fq is not None:  # compressed-tensors' global scale: 2688 / amax (fp32)
            expected = 2688.0 / fq.static_scale.amax  # a Python float over a tensor, as ct writes it
            assert torch.equal(tensors[f"{name}.input_global_scale"], expected.reshape(1)), name
    ours, tensors, _ = exported("FP8", tmp_path / "fp8")
    fq = ours.model.layers[1].mlp.down_proj.input_fake_quant
    expected = fq.static_scale.amax / torch.tensor(448.0)
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.input_scale"], expected.reshape(1))


def test_nvfp4_fused_siblings_share_one_global_scale(tmp_path):
    _, tensors, _ = exported("NVFP4A16", tmp_path)
    prefix = "model.layers.0."
    q, k, v = (tensors[f"{prefix}self_attn.{p}_proj.weight_global_scale"] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v)
    gate, up, down = (tensors[f"{prefix}mlp.{p}_proj.weight_global_scale"] for p in ("gate", "up", "down"))
    assert torch.equal(gate, up) and not torch.equal(gate, down)


def test_noise_is_left_out_of_the_checkpoint(tmp_path):
    """QeRL's preset is NVFP4A16 plus AQN on the norms: the deployed model is the clean one."""
    model = build_tiny("qwen2", hidden=HIDDEN)
    noisy = qtransform.transform(model, {"preset": "qerl", "noise": {"apply_during": "both",
                                                                      "schedule": {"total_steps": 10}}})
    qtransform.noise_controller(noisy).set_step(5)
    qtransform.export_checkpoint(noisy, tmp_path / "noisy")
    clean = qtransform.transform(model, {"preset": "llm-compressor/NVFP4A16"})
    qtransform.export_checkpoint(clean, tmp_path / "clean")
    a, b = read(tmp_path / "noisy"), read(tmp_path / "clean")
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)


def test_a_plain_model_with_a_policy_is_transformed_on_a_copy(tmp_path):
    model = build_tiny("llama", hidden=HIDDEN)
    before = snapshot(model)
    qtransform.export_checkpoint(model, tmp_path / "out", policy={"preset": "llm-compressor/W4A16"})
    assert_untouched(before, model)
    ours = qtransform.transform(model, {"preset": "llm-compressor/W4A16"})
    qtransform.export_checkpoint(ours, tmp_path / "again")
    a, b = read(tmp_path / "out"), read(tmp_path / "again")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "out" / "generation_config.json").exists()


def test_mixed_schemes_get_one_config_group_each_with_explicit_targets(tmp_path):
    model = build_tiny("qwen2", hidden=HIDDEN)
    policy = {"quantize": [
        {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4", "scale_rule": "even"},
        {"targets": ["mlp.down_proj"], "format": "int8", "granularity": "channel", "int_range": "full"}]}
    ours = qtransform.transform(model, policy)
    qtransform.export_checkpoint(ours, tmp_path / "out")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    groups = {g["format"]: g for g in qc["config_groups"].values()}
    assert groups["pack-quantized"]["targets"] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert len(groups["mxfp4-pack-quantized"]["targets"]) == 12
    tensors = read(tmp_path / "out")
    for name in groups["pack-quantized"]["targets"]:
        module = ours.get_submodule(name)
        got = decode(tensors, name, groups["pack-quantized"]["weights"], torch.float32)
        assert torch.equal(got, module.weight_fake_quant.quantized_copy(module.weight))


def test_a_tokenizer_is_written_beside_the_weights(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<unk>": 1},
                                                                              unk_token="<unk>")))
    model = build_tiny("qwen2", hidden=HIDDEN)
    qtransform.export_checkpoint(model, tmp_path / "out", policy={"preset": "llm-compressor/MXFP4A16"},
                                 tokenizer=tok)
    assert (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
