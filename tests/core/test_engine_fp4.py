"""FP4 activations as vLLM's CUDA backends run a compressed-tensors NVFP4 checkpoint
(`checkpoint_policy(model, engine="vllm", backend=...)`, `core/engines.py` `fp4_input_fields`):
on Hopper (flash-attn-3) Marlin runs the weights only, the activations stay in 16 bits; on FP4
GPUs (triton) `scaled_fp4_quant` quantizes them with the stored input_global_scale, and
`nvfp4_4over6` adds FlashInfer's four over six; the default stays the producer's."""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.formats import fake_quantize
from qtransform.models import build_tiny, load_model, loaded_checkpoint
from tests.formats.test_nvfp4_vllm import F32, port

PROMPT = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp4_engine") / "nvfp4"
    qtransform.export_checkpoint(build_tiny("qwen2", num_layers=1), path, policy={"preset": "llm-compressor/NVFP4"},
                                 calibration=[torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))])
    return path


def linear_io(folder, **kwargs) -> tuple[dict, torch.nn.Module]:
    """Each quantized Linear's (input, output) in the model `checkpoint_policy(**kwargs)` gives."""
    model = load_model(folder)
    ours = qtransform.transform(model, qtransform.checkpoint_policy(model, **kwargs))
    seen = {}
    for name in loaded_checkpoint(model).modules:
        ours.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, (a[0].detach(), o.detach())))
    with torch.no_grad():
        ours(PROMPT)
    return seen, model


def test_fp4_gpus_quantize_the_activations_as_scaled_fp4_quant(folder):
    seen, model = linear_io(folder, engine="vllm", backend="triton")
    stored = loaded_checkpoint(model).input_scales
    for name, (x, y) in seen.items():
        g = stored[name].reshape(()).float()
        w = model.get_submodule(name).weight
        xq = port(x.reshape(-1, x.shape[-1]), F32(g.item())).reshape(x.shape)
        assert torch.equal(y, torch.nn.functional.linear(xq, w)), name
    # the producer's order (x / (SF / g)) lands elsewhere on some input
    assert any(not torch.equal(port(x.reshape(-1, x.shape[-1]), F32(stored[n].item())).reshape(x.shape),
                               fake_quantize(x, "nvfp4", nvfp4_variant="compressed-tensors",
                                             scale=stored[n].reshape(()).float(), scale_dtype="input"))
               for n, (x, _) in seen.items())


@pytest.mark.parametrize("mode", ["mae", "mse"])
def test_flashinfer_four_over_six_on_the_activations(folder, mode):
    seen, model = linear_io(folder, engine="vllm", backend="triton", nvfp4_4over6=mode)
    plain, _ = linear_io(folder, engine="vllm", backend="triton")
    stored = loaded_checkpoint(model).input_scales
    moved = 0
    for name, (x, y) in seen.items():
        g = stored[name].reshape(()).float()
        xq = fake_quantize(x, "nvfp4", nvfp4_variant="vllm", four_over_six=mode, scale=g)
        assert torch.equal(y, torch.nn.functional.linear(xq, model.get_submodule(name).weight))
        moved += int(not torch.equal(y, plain[name][1]))
    assert moved > 0


def test_hopper_runs_the_weights_only(folder):
    seen, model = linear_io(folder, engine="vllm", backend="flash-attn-3")
    for name, (x, y) in seen.items():
        assert torch.equal(y, torch.nn.functional.linear(x, model.get_submodule(name).weight))
    assert qtransform.checkpoint_policy(model, engine="vllm", backend="flash-attn-3")["quantize"] == []


def test_the_default_is_the_producers(folder):
    model = load_model(folder)
    [rule] = qtransform.checkpoint_policy(model)["quantize"]
    assert rule["nvfp4_variant"] == "compressed-tensors"


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"nvfp4_4over6": "mae"}, "FP4 GPUs (backend triton)"),
    ({"engine": "vllm", "backend": "flash-attn-3", "nvfp4_4over6": "mae"}, "FP4 GPUs (backend triton)"),
    ({"engine": "vllm", "backend": "triton", "nvfp4_4over6": "max"}, "choose one of mae, mse"),
])
def test_refusals_are_one_line(folder, kwargs, words):
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")) as exc:
        qtransform.checkpoint_policy(load_model(folder), **kwargs)
    assert "\n" not in str(exc.value)
