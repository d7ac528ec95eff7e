"""Activation scans of checkpoints larger than memory: one decoder layer at a time.

`scan_activations` holds the whole model twice (full precision and transformed). A sequential
scan reads a safetensors checkpoint instead and keeps one decoder layer's weights at a time:

1. both models are built with their parameters on the meta device (no memory; buffers such as
   rotary frequencies stay real) and the transformed one comes from the same `transform` as in
   memory, so sites, policy selection and taps are the same objects;
2. the embedding is loaded and every calibration batch runs through the model with identity
   layers, which records what the model passes each layer (the first layer's hidden states, the
   attention mask and position embeddings) until a hook on the final norm stops it; the
   embedding is released;
3. for each decoder layer: its tensors are read from the checkpoint and assigned to both models'
   copies of the layer (one tensor, two modules), every batch's full-precision hidden states go
   through the full-precision layer and the quantized stream's through the transformed layer
   (taps and site pairs record as in memory), and the layer goes back to meta;
4. the final norm and the LM head turn both streams into logits for the end-to-end comparison.

Each site sees the same inputs, in the same batch order, as in the in-memory scan, so the report
is the same bit for bit (tests/scan/test_scan_sequential.py). Peak memory: one layer (plus the
embedding or the head while they run) and the two streams' hidden states of the whole
calibration set, `2 x samples x tokens x hidden` elements.

Supported: decoder-only causal LMs laid out like Llama and Qwen2 (`model.embed_tokens`,
`model.layers`, `model.norm`, `lm_head`), which covers Llama, Mistral, Qwen2/3 and their kin;
the model must call its layers with the hidden states as first argument and return logits as
`lm_head(norm(h))`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from qtransform.calibration import Calibration, run_model
from qtransform.checkpoints.shards import TensorFiles
from qtransform.core.progress import Progress
from qtransform.errors import UserError
from qtransform.models import model_class, read_config
from qtransform.passes.fake_quant import FakeQuantize
from qtransform.passes.instrument import reset_taps, tapping
from qtransform.pipeline.transform import static_rules
from qtransform.scan.activations import activation_report
from qtransform.scan.measure import EndToEnd, SitePairs
from qtransform.scan.report import ScanReport
from qtransform.scan.setup import CalibrationSpec, as_policy, prepare_scan

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from qtransform.schemas import PolicyLike


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside goes to the meta device at once (buffers stay real):
    a skeleton of any size costs nothing, and its initializers run on meta tensors."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(folder: Path) -> nn.Module:
    """The checkpoint's model class built from its config, every parameter on meta."""
    import transformers as tf  # imported when used: `import qtransform` does not load transformers

    read_config(folder)
    config = tf.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    cls = model_class(config)
    with parameters_on_meta():
        model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
    return model.eval()


def decoder_parts(model: nn.Module) -> tuple[str, nn.Module, nn.ModuleList, nn.Module, nn.Module]:
    """(base prefix, embedding, layers, final norm, LM head) of a Llama/Qwen2-style causal LM."""
    base = getattr(model, "model", None)
    parts = [getattr(base, n, None) for n in ("embed_tokens", "layers", "norm")]
    head = getattr(model, "lm_head", None)
    if base is None or head is None or any(p is None for p in parts) \
            or not isinstance(parts[1], nn.ModuleList):
        raise UserError(f"{type(model).__name__}: a sequential scan runs decoder-only causal LMs "
                        "laid out like Llama or Qwen2 (model.embed_tokens, model.layers, "
                        "model.norm, lm_head); scan this model in memory (without --sequential)")
    return "model", parts[0], parts[1], parts[2], head


def assign(module: nn.Module, prefix: str, tensors: dict[str, Tensor]) -> None:
    """Give `module` the checkpoint's tensors under `prefix` (every parameter must be there)."""
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = [n for n, _ in module.named_parameters() if n not in state]
    if missing:
        raise UserError(f"the checkpoint has no {prefix}{missing[0]} (and {len(missing) - 1} more "
                        "missing); is it complete?")
    module.load_state_dict(state, strict=False, assign=True)


def release(module: nn.Module) -> None:
    """Put every parameter of `module` back on meta and drop cached quantized weights, freeing
    their memory."""
    for sub in module.modules():
        if isinstance(sub, FakeQuantize):
            sub.clear_cache()
        for name, p in list(sub._parameters.items()):
            if p is not None and p.device.type != "meta":
                sub._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)


class _Stop(Exception):
    """Raised by the hook on the final norm: the layers' inputs are all recorded."""


LayerCall = tuple[tuple, dict[str, Any]]  # a layer's positional args after the hidden states, kwargs


def layer_inputs(model: nn.Module, layers: nn.ModuleList, norm: nn.Module,
                 batch: Tensor) -> tuple[Tensor, list[LayerCall]]:
    """The first layer's hidden states and what the model passes each layer beside them
    (attention mask, position embeddings), recorded by a forward in which every layer is the
    identity and the final norm stops it: nothing but the embedding needs weights, and layers
    of different kinds (sliding-window and full attention) keep their own masks."""
    calls: list[LayerCall] = []
    first: list[Tensor] = []

    def recorder(*args: object, **kwargs: object) -> Any:
        h = args[0] if args else kwargs.pop("hidden_states")
        if not first:
            first.append(h)
        calls.append((args[1:], kwargs))
        return h

    def stop(module: nn.Module, args: tuple) -> None:
        raise _Stop

    handle = norm.register_forward_pre_hook(stop)
    for layer in layers:
        layer.forward = recorder  # an instance attribute, deleted below
    try:
        with torch.no_grad():  # a graph would keep the embedding alive through its hidden states
            run_model(model, batch)
    except _Stop:
        pass
    finally:
        handle.remove()
        for layer in layers:
            del layer.forward
    if len(calls) != len(layers):
        raise UserError(f"{type(model).__name__} called {len(calls)} of its {len(layers)} decoder "
                        "layers once each: a sequential scan cannot run it")
    return first[0], calls


def hidden(output: Tensor | tuple[Tensor, ...]) -> Tensor:
    """A layer's hidden states (older layers return a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def tensor_names(files: dict[str, Path], prefix: str) -> list[str]:
    return [n for n in files if n.startswith(prefix)]


def scan_sequential(checkpoint: str | os.PathLike, policy_or_format: PolicyLike, calib: Calibration | CalibrationSpec, *,
                    tokenizer: PreTrainedTokenizerBase | None = None, batch_size: int = 8, max_length: int = 128,
                    token_stride: int | None = None, progress: bool | None = False,
                    dtype: torch.dtype | None = None) -> ScanReport:
    """`scan_activations` on a safetensors checkpoint folder, one decoder layer in memory at a
    time (see the module docstring); the report equals the in-memory scan's of the model
    `qtransform.models.load_model(checkpoint, dtype=dtype)` loads. `dtype`: convert the weights
    as they are read (None: as stored)."""
    folder = Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"{checkpoint}: a sequential scan reads a checkpoint folder "
                        "(config.json and safetensors)")
    model = skeleton(folder)
    if static_rules(as_policy(model, policy_or_format, activations=True)):
        raise UserError("a sequential scan cannot calibrate static scales (scale_source "
                        '"static"): scan the model in memory (without --sequential)')
    base, embed, layers, norm, head = decoder_parts(model)
    ckpt = TensorFiles(folder)
    setup = prepare_scan(model, policy_or_format, CalibrationSpec.of(calib, tokenizer, batch_size, max_length))
    program, sites, batches = setup.program, setup.sites, setup.batches
    quant = setup.quant
    _, _, q_layers, q_norm, q_head = decoder_parts(quant)
    layers_prefix = f"{base}.layers."
    outside = [program.sites[s].module_name for s in program.sites
               if not program.sites[s].module_name.startswith(layers_prefix)
               and program.insertions(site=s)]
    if any(not (m == f"{base}.norm" or m == "lm_head") for m in outside):
        raise UserError(f"the policy transforms {outside[0]}, outside the decoder layers, the "
                        "final norm and the LM head: scan this model in memory")
    token_stride = setup.stride(token_stride)

    embed_name = f"{base}.embed_tokens.weight"
    assign(embed, f"{base}.embed_tokens.", ckpt.load([embed_name], dtype))
    inputs = [layer_inputs(model, layers, norm, b) for b in batches]
    release(embed)
    fp_states = [h for h, _ in inputs]
    q_states = list(fp_states)

    end = EndToEnd(True, token_stride)
    reset_taps(quant)
    with SitePairs(model, quant, sites, token_stride, setup.site_modules()) as pairs, \
            tapping(quant, True, stride=token_stride) as found, torch.no_grad():
        for i in Progress(range(len(layers)), desc="sequential scan", unit="layer", enabled=progress):
            prefix = f"{layers_prefix}{i}."
            tensors = ckpt.load(tensor_names(ckpt.files, prefix), dtype)
            assign(layers[i], prefix, tensors)
            assign(q_layers[i], prefix, tensors)
            del tensors
            for k, (_, calls) in enumerate(inputs):
                args, kwargs = calls[i]
                fp_states[k] = hidden(layers[i](fp_states[k], *args, **kwargs))
                q_states[k] = hidden(q_layers[i](q_states[k], *args, **kwargs))
            release(layers[i])
            release(q_layers[i])
        head_name = "lm_head.weight" if "lm_head.weight" in ckpt.files else embed_name
        if head_name != "lm_head.weight" and not getattr(model.config, "tie_word_embeddings", False):
            raise UserError(f"{checkpoint}: no lm_head.weight and the embeddings are not tied")
        tail = ckpt.load([n for n in ckpt.files if n.startswith(f"{base}.norm.")] + [head_name],
                         dtype)
        tail["lm_head.weight"] = tail.pop(head_name)
        for fp_mod, q_mod, prefix in ((norm, q_norm, f"{base}.norm."), (head, q_head, "lm_head.")):
            assign(fp_mod, prefix, tail)
            assign(q_mod, prefix, tail)
        del tail
        for batch, fp_h, q_h in zip(batches, fp_states, q_states, strict=True):
            fp_logits = head(norm(fp_h))
            q_logits = q_head(q_norm(q_h))
            pairs.end_batch()
            end.update(batch, fp_logits, q_logits)
        for module in (norm, q_norm, head, q_head):
            release(module)
    report = activation_report(setup, found, pairs, end, token_stride)
    report.meta["source"] = str(checkpoint)
    report.meta["calibration"]["sequential"] = True
    return report
