"""Sequential (layer-by-layer) activation scans equal the in-memory scan, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model, tiny_config
from qtransform.scan.activations import scan_activations
from qtransform.scan.sequential import parameters_on_meta, scan_sequential
from tests.conftest import ids

# differs between the two by construction: the source label, the time, the mode flag
VOLATILE = ("source", "created")


def comparable(report) -> dict:
    data = json.loads(report.to_json())
    for key in VOLATILE:
        data["meta"].pop(key)
    data["meta"]["calibration"].pop("sequential", None)
    return data


def save(model: torch.nn.Module, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


def sliding_qwen2() -> torch.nn.Module:
    """Qwen2 whose first layer has full attention and the others a 4-token window: each layer
    needs its own mask, which a scan reusing the first layer's would get wrong."""
    config = tiny_config("qwen2", num_layers=3)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 1
    config.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(3)
    return tf.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("case", ["qwen2", "llama-bf16-stride", "qwen2-sliding-lm_head"])
def test_sequential_scan_equals_in_memory(tmp_path, case):
    """Every row, the accumulated errors and the end-to-end metrics are the same numbers."""
    fmt = "mxfp4"
    stride = None
    if case == "qwen2":
        model = build_tiny("qwen2", num_layers=3)
    elif case == "llama-bf16-stride":
        model, fmt, stride = build_tiny("llama", num_layers=2, dtype=torch.bfloat16), "nvfp4", 3
    else:
        model = sliding_qwen2()
        fmt = {"version": 1, "quantize": [{"targets": ["Linear"], "format": "mxfp8_e4m3",
                                           "tensors": ["weight", "input"]}]}
    folder = save(model, tmp_path / "ckpt")
    calib = ids(5, 12)
    in_memory = scan_activations(load_model(folder), fmt, calib, batch_size=2, token_stride=stride)
    sequential = scan_sequential(folder, fmt, calib, batch_size=2, token_stride=stride)
    a, b = comparable(in_memory), comparable(sequential)
    assert [r["site"] for r in a["rows"]] == [r["site"] for r in b["rows"]]
    assert a["rows"] == b["rows"]
    assert a == b
    assert sequential.meta["calibration"]["sequential"] is True
    if case == "qwen2-sliding-lm_head":
        assert any(r["site"] == "lm_head" for r in b["rows"])


def test_sliding_window_masks_matter(tmp_path):
    """The sliding-window case above can fail: its layers really see different masks (the
    end-to-end loss of the model differs from the same weights with full attention)."""
    model = sliding_qwen2()
    batch = ids(1, 12)
    windowed = model(batch, use_cache=False).logits
    model.config.layer_types = ["full_attention"] * 3
    for layer in model.model.layers:
        layer.attention_type = "full_attention"
    full = model(batch, use_cache=False).logits
    assert not torch.equal(windowed, full)


def test_sequential_scan_keeps_one_layer(tmp_path, monkeypatch):
    """While a layer runs, no other layer holds real weights (the memory claim)."""
    from qtransform.scan import sequential

    folder = save(build_tiny("qwen2", num_layers=3), tmp_path / "ckpt")
    seen: list[int] = []
    real_assign = sequential.assign

    def spy(module, prefix, tensors):
        real_assign(module, prefix, tensors)
        root = spy.models[-1] if spy.models else None
        if root is not None:
            loaded = {n.split(".")[2] for n, p in root.named_parameters()
                      if n.startswith("model.layers.") and p.device.type != "meta"}
            seen.append(len(loaded))

    spy.models = []
    real_skeleton = sequential.skeleton

    def keep(folder):
        model = real_skeleton(folder)
        spy.models.append(model)
        return model

    monkeypatch.setattr(sequential, "assign", spy)
    monkeypatch.setattr(sequential, "skeleton", keep)
    scan_sequential(folder, "mxfp4", ids(2, 8), batch_size=2)
    assert seen and max(seen) == 1
    assert all(p.device.type == "meta" for p in spy.models[0].parameters())


def test_parameters_on_meta_keeps_buffers():
    """Rotary frequencies are buffers: they stay real, the parameters cost nothing."""
    config = tiny_config("qwen2")
    with parameters_on_meta():
        model = tf.Qwen2ForCausalLM(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq
    dim = config.hidden_size // config.num_attention_heads
    expected = 1.0 / (config.rope_parameters["rope_theta"]
                      ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    assert inv_freq.device.type == "cpu"
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_sequential_scan_refuses_other_layouts(tmp_path):
    folder = save(build_tiny("gpt2"), tmp_path / "gpt2")
    with pytest.raises(UserError, match="laid out like Llama"):
        scan_sequential(folder, "mxfp4", ids(2, 8))


def test_cli_sequential_matches(tmp_path):
    """`scan --calib FILE --sequential` writes the report the in-memory CLI scan writes."""
    from qtransform.cli.main import main

    folder = save(build_tiny("qwen2"), tmp_path / "ckpt")
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps(ids(3, 10).tolist()))
    outs = {}
    for mode in ("memory", "sequential"):
        out = tmp_path / mode
        argv = ["scan", folder, "--format", "mxfp4", "--calib", str(calib), "--out", str(out)]
        assert main(argv + (["--sequential"] if mode == "sequential" else [])) == 0
        outs[mode] = json.loads((out / "report.json").read_text())
    for data in outs.values():
        for key in VOLATILE:
            data["meta"].pop(key)
        data["meta"]["calibration"].pop("sequential", None)
    assert outs["memory"]["rows"] == outs["sequential"]["rows"]
    assert outs["memory"]["meta"] == outs["sequential"]["meta"]
    assert main(["scan", folder, "--format", "mxfp4", "--sequential",
                 "--out", str(tmp_path / "x")]) == 2


def _sharded(tmp_path) -> tuple[torch.nn.Module, str]:
    model = build_tiny("qwen2", num_layers=3)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="60KB")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 2
    return model, str(tmp_path / "ckpt")


def test_sequential_scan_of_a_sharded_checkpoint_equals_in_memory(tmp_path):
    model, folder = _sharded(tmp_path)
    calib = ids(3, 10)
    assert comparable(scan_sequential(folder, "mxfp4", calib)) == comparable(scan_activations(model, "mxfp4", calib))


def _edit_index(folder: str, edit) -> None:
    index = Path(folder) / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    edit(data["weight_map"])
    index.write_text(json.dumps(data))


def _move_first(weight_map: dict) -> None:
    name = next(iter(weight_map))
    weight_map[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])


@pytest.mark.parametrize("damage", ["index maps a tensor to another shard", "truncated shard",
                                    "no index", "tensor in two shards"])
def test_both_checkpoint_scans_read_through_the_one_hardened_reader(tmp_path, damage):
    """Each damage is refused with one clear error by the weight scan and the sequential scan
    alike (the sequential scan had its own reader, which trusted the index and the headers)."""
    from safetensors.torch import load_file, save_file

    from qtransform.scan import scan_weights

    _, folder = _sharded(tmp_path)
    shards = sorted(Path(folder).glob("*.safetensors"))
    if damage == "index maps a tensor to another shard":
        _edit_index(folder, _move_first)
        words = "does not match its shards"
    elif damage == "truncated shard":
        shards[1].write_bytes(shards[1].read_bytes()[:-100])
        words = "truncated or corrupt"
    elif damage == "no index":
        (Path(folder) / "model.safetensors.index.json").unlink()
        words = "not one sharded checkpoint"
    else:
        first, second = load_file(shards[0]), load_file(shards[1])
        save_file({**second, **dict(list(first.items())[:1])}, str(shards[1]))
        words = "is in two shards"
    with pytest.raises(UserError, match=words):
        scan_weights(folder, "mxfp4")
    with pytest.raises(UserError, match=words):
        scan_sequential(folder, "mxfp4", ids(2, 8))
