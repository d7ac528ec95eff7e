"""The checkpoint writer's parts: bit packing, the fast element/scale path against the formats'
reference, and the streaming, sharded, atomic safetensors writer."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import qtransform
from qtransform.checkpoints.packing import (
    e2m1_codes,
    pack_int32,
    pack_nibbles,
    unpack_fp4,
    unpack_int32,
)
from qtransform.core import io as qio
from qtransform.export.checkpoint.collect import collect
from qtransform.export.checkpoint.compressed_tensors import schemes
from qtransform.export.checkpoint.export import tensor_entries
from qtransform.export.checkpoint.writer import (
    Entry,
    Spec,
    plan_shards,
    shard_size,
    write_file,
    write_shards,
)
from qtransform.formats import QuantConfig
from qtransform.formats import stored as T
from qtransform.formats.elements import decode_elements, encode_elements
from qtransform.formats.registry import E2M1
from qtransform.models import build_tiny


def test_e2m1_codes_are_the_formats_codes():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    q = torch.cat([grid, -grid])  # -0.0 included: code 8
    assert torch.equal(e2m1_codes(q), encode_elements(q, E2M1))
    assert e2m1_codes(torch.tensor([-0.0])).item() == 8


def test_nibbles_put_the_even_column_low():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x0F]]
    # the checkpoint reader (qtransform.checkpoints) decodes them back
    assert torch.equal(unpack_fp4(pack_nibbles(codes)), decode_elements(codes, E2M1))


def test_int32_packing_by_hand():
    """int4 -8..7 offset by 8 is 0..15: eight per word, element i at bits 4i."""
    values = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 16)
    words = pack_int32(values, 4)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() == 0x76543210
    assert words[0, 1].item() == 0xFEDCBA98 - 2**32
    assert pack_int32(torch.tensor([[-1, 2]], dtype=torch.int8), 3).tolist() == [[(3 | (6 << 3))]]


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 8), cols=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int32_packing_round_trips(bits, cols, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (3, cols), generator=g).to(torch.int8)
    packed = pack_int32(values, bits)
    assert packed.shape == (3, -(-cols * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, cols), values.to(torch.int32))  # the reader's


CONFIGS = {
    "nvfp4-ct": ("nvfp4", {"nvfp4_variant": "compressed-tensors"}),
    "nvfp4-ct-input": ("nvfp4", {"nvfp4_variant": "compressed-tensors", "scale_dtype": "input"}),
    "nvfp4-modelopt": ("nvfp4", {"nvfp4_variant": "modelopt"}),
    "mxfp4-even": ("mxfp4", {"scale_rule": "even"}),
    "fp8-channel": ("fp8_e4m3", {"granularity": "channel", "scale_dtype": "input"}),
    "fp8-tensor": ("fp8_e4m3", {"granularity": "tensor"}),
    "fp8-tile": ("fp8_e4m3", {"block_shape": (32, 32)}),
    "int4-full": ("int4", {"block_size": 32, "int_range": "full", "scale_dtype": "input"}),
    "int8-channel": ("int8", {"granularity": "channel", "int_range": "full"}),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-3, 1.0, 1e3]))
def test_the_fast_path_equals_the_reference(name, dtype, seed, magnitude):
    fmt, options = CONFIGS[name]
    config = QuantConfig.from_options(fmt, options).bind(-1)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(64, 96, generator=g) * magnitude).to(dtype)
    w[3, :16] = 0.0  # a zero block
    amax = T.tensor_amax(w) if config.family.per_tensor(config) else None
    fast = T._fast(w, 0, config, amax)
    ref = T._reference(w, 0, config, amax)
    assert fast is not None
    assert torch.equal(torch.signbit(fast.elements), torch.signbit(ref.elements))
    assert torch.equal(fast.elements, ref.elements)
    assert torch.equal(fast.scales, ref.scales)
    assert (fast.tensor_scale is None) == (ref.tensor_scale is None)
    if ref.tensor_scale is not None:
        assert torch.equal(fast.tensor_scale, ref.tensor_scale)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_the_fast_path_never_guesses_tiny_weights(name, dtype):
    """Weights whose dequantized values fall among the 16-bit subnormals (or past the range)
    round several grid values to one number: the fast path hands them to the reference path
    rather than guess an element (it used to store 6.5 for a clamped 6 in fp16)."""
    fmt, options = CONFIGS[name]
    config = QuantConfig.from_options(fmt, options).bind(-1)
    tiny = torch.finfo(dtype).smallest_normal
    w = (torch.linspace(-1.0, 1.0, 64 * 96).reshape(64, 96) * tiny * 4).to(dtype)
    amax = T.tensor_amax(w) if config.family.per_tensor(config) else None
    fast = T._fast(w, 0, config, amax)
    ref = T._reference(w, 0, config, amax)
    assert fast is None or torch.equal(fast.elements, ref.elements)


def spec(name: str, tensor: torch.Tensor) -> Spec:
    return Spec(name, tensor.dtype, tuple(tensor.shape))


def test_the_writer_holds_one_entry_at_a_time(tmp_path):
    made: list[weakref.ref] = []
    alive_at_make: list[int] = []

    def make(i: int):
        def produce():
            gc.collect()
            alive_at_make.append(sum(r() is not None for r in made))
            t = torch.full((256, 256), float(i))
            made.append(weakref.ref(t))
            return {f"t{i}": t}
        return produce

    entries = [Entry((Spec(f"t{i}", torch.float32, (256, 256)),), make(i)) for i in range(6)]
    write_file(tmp_path / "x.safetensors", entries)
    assert alive_at_make == [0] * 6  # each entry's tensors are gone when the next is made
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[f"t{i}"], torch.full((256, 256), float(i))) for i in range(6))


def test_a_failed_write_raises_before_the_next_entry_is_made(tmp_path):
    made: list[int] = []

    def make(i: int):
        def produce():
            made.append(i)
            return {f"t{i}": torch.zeros(4, dtype=torch.float16)}  # planned float32: refused
        return produce

    entries = [Entry((Spec(f"t{i}", torch.float32, (4,)),), make(i)) for i in range(5)]
    with pytest.raises(AssertionError, match="t0: planned"):
        write_file(tmp_path / "x.safetensors", entries)
    assert made == [0]


def test_an_export_streams_its_tensors(tmp_path):
    """On a model, each produced tensor is released before the next entry is computed."""
    model = qtransform.transform(build_tiny("qwen2", hidden=128), {"preset": "llm-compressor/NVFP4A16"})
    collected = collect(model)
    found, _ = schemes(collected)
    from qtransform.export.checkpoint import compressed_tensors

    entries = tensor_entries(model, collected, found, compressed_tensors)
    refs: list[weakref.ref] = []
    alive: list[int] = []

    def tracked(entry: Entry) -> Entry:
        def produce():
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
            tensors = entry.make()
            fresh = [t for n, t in tensors.items() if "weight_packed" in n]
            refs.extend(weakref.ref(t) for t in fresh)
            return tensors
        return Entry(entry.specs, produce)

    write_shards(tmp_path, [tracked(e) for e in entries], "5GB")
    assert len(refs) == 14 and set(alive) == {0}


def test_sharded_output_has_an_index_and_the_same_tensors(tmp_path):
    model = qtransform.transform(build_tiny("qwen2", hidden=128), {"preset": "llm-compressor/W4A16"})
    qtransform.export_checkpoint(model, tmp_path / "one")
    qtransform.export_checkpoint(model, tmp_path / "many", max_shard_size="100KB")
    files = sorted(p.name for p in (tmp_path / "many").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    whole = load_file(tmp_path / "one" / "model.safetensors")
    assert sorted(index["weight_map"]) == sorted(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for file in files:
        part = load_file(tmp_path / "many" / file)
        assert all(index["weight_map"][k] == file and torch.equal(v, whole[k]) for k, v in part.items())
        assert (tmp_path / "many" / file).stat().st_size < 100_000 + 20_000 or len(part) == 1


def test_shard_plan_and_sizes():
    entries = [Entry((Spec(f"t{i}", torch.uint8, (n,)),), dict) for i, n in enumerate([40, 40, 150, 10])]
    assert [[e.specs[0].name for e in s] for s in plan_shards(entries, 100)] == [["t0", "t1"], ["t2"], ["t3"]]
    assert shard_size("5GB") == 5 * 10**9 and shard_size("2MiB") == 2 * 2**20 and shard_size(7) == 7
    with pytest.raises(qtransform.UserError, match="max_shard_size"):
        shard_size("0.5 parsecs")


def test_a_failure_while_writing_leaves_nothing(tmp_path):
    def boom():
        raise RuntimeError("disk on fire")

    entries = [Entry((Spec("a", torch.float32, (4,)),), lambda: {"a": torch.zeros(4)}),
               Entry((Spec("b", torch.float32, (4,)),), boom)]
    with pytest.raises(RuntimeError, match="disk on fire"):
        with qio.output_folder(tmp_path / "out", "export") as staging:
            write_shards(staging, entries, "5GB")
    assert list(tmp_path.iterdir()) == []
