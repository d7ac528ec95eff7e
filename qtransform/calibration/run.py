"""The calibration run: static scales from a full-precision forward over batches of model
inputs, then frozen (`calibrate`), and the one forward of a calibration batch.

Observers see real tokens only, as llm-compressor calibrates on unpadded samples: a batch's
`attention_mask` is checked against its inputs and handed to the observers
(`core.observers.real_tokens`), which drop the padded positions before their statistics. A
left-padded batch also gets the `position_ids` its sequences would have alone (as transformers'
`generate` computes them), so that each real token is the same activation as unpadded. Batches
without a mask run as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from qtransform.core import attention as attention_impl
from qtransform.core.capture import forward_params, normalize_inputs
from qtransform.core.noise import noise_modules
from qtransform.core.observers import collect, real_tokens, static_scales
from qtransform.errors import UserError

CalibrationBatches = Iterable[Mapping[str, Any] | Tensor]


def run_model(model: nn.Module, batch: Tensor) -> Any:
    """One forward on a calibration batch (causal LMs without a KV cache)."""
    if batch.is_floating_point():
        return model(batch)
    args, kwargs = normalize_inputs(model, {"input_ids": batch})
    return model(*args, **kwargs)


def calibrate(model: nn.Module, batches: CalibrationBatches, *, attention: str = "model",
              tensors: Sequence[str] | None = None) -> int:
    """Calibrate every static scale of a transformed model on `batches` (model-input dicts, or
    input_ids / input tensors), then freeze them; returns the number of batches. `tensors`
    recalibrates only the scales of those tensors (["key", "value"]: the KV-cache scales, which
    follow the weights after each update in an RL loop, as NeMo RL recomputes them), leaving
    the others as they are.

    The model runs as it would deployed before quantization, as llm-compressor's and ModelOpt's
    calibration do: eval mode, no gradient, every fake-quant and noise module passing its tensor
    through (`core.observers.collecting`), no KV cache; `attention` "eager" runs transformers'
    eager attention meanwhile (llm-compressor's calibration does). Training mode, noise switches
    and the attention are put back afterwards. Observers see the real tokens of each batch only
    (its `attention_mask`: see the module docstring). A static scale that no batch reached is an
    error naming it."""
    scales = {name: s for name, s in static_scales(model).items() if tensors is None or s.tensor in tensors}
    if not scales:
        if tensors is not None:
            raise UserError(f"calibration: the model has no static scale of {', '.join(tensors)}; "
                            "its quantize rules calibrate none (scale_source 'static')")
        return 0
    for scale in scales.values():
        scale.start()
    noise = [(m, m.enabled) for m in noise_modules(model)]
    training = [(m, m.training) for m in model.modules()]
    count = 0
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    try:
        if attention == "eager" and config is not None:
            config._attn_implementation = attention_impl.running(attn, "eager")
        model.eval()
        for m, _ in noise:
            m.enabled = False
        with torch.no_grad(), collect():
            for batch in batches:
                run_batch(model, batch, count)
                count += 1
    finally:
        if attention == "eager" and config is not None:
            config._attn_implementation = attn
        for m, enabled in noise:
            m.enabled = enabled
        for m, mode in training:
            m.training = mode
    if count == 0:
        raise UserError("calibration: no batches; give at least one batch of model inputs")
    missed = [name for name, scale in scales.items() if scale.calls == 0]
    if missed:
        raise UserError(f"calibration: no batch reached {len(missed)} static scale(s), e.g. "
                        f"{missed[0]}; calibrate on inputs that run those modules")
    for scale in scales.values():
        scale.freeze()
    return count


def run_batch(model: nn.Module, batch: Mapping[str, Any] | Tensor, index: int = 0) -> Any:
    """One forward on calibration batch `index` (a dict of keyword inputs, token ids or a float
    input tensor), moved to the model's device, without a KV cache; a dict's `attention_mask`
    tells the observers its real tokens."""
    device = next((p.device for p in model.parameters()), None)
    if isinstance(batch, Tensor):
        return run_model(model, batch if device is None else batch.to(device))
    if not isinstance(batch, Mapping):
        raise UserError(f"a calibration batch must be a dict of model inputs or a tensor of "
                        f"token ids, got {type(batch).__name__}")
    inputs = {k: v.to(device) if isinstance(v, Tensor) and device is not None else v
              for k, v in batch.items()}
    mask = token_mask(inputs, index)
    if mask is not None:
        inputs = unpadded_positions(model, inputs, mask)
    args, kwargs = normalize_inputs(model, inputs)
    with real_tokens(mask):
        return model(*args, **kwargs)


def token_mask(inputs: Mapping[str, Any], index: int = 0) -> Tensor | None:
    """The batch's `attention_mask` (None without one), checked: [batch, tokens] as its
    input_ids (or the leading dims of inputs_embeds), 1 at real tokens and 0 at padding."""
    mask = inputs.get("attention_mask")
    if mask is None:
        return None
    tokens = inputs.get("input_ids", inputs.get("inputs_embeds"))
    want = tuple(tokens.shape[:2]) if isinstance(tokens, Tensor) and tokens.ndim >= 2 else None
    got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
    if not isinstance(mask, Tensor) or mask.ndim != 2 or (want is not None and got != want):
        raise UserError(f"calibration batch {index}: attention_mask of shape {got} does not match "
                        f"its tokens {want or '[batch, tokens]'}; give one 0 or 1 per token")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise UserError(f"calibration batch {index}: attention_mask holds values other than 0 and "
                        "1; give 1 at real tokens and 0 at padding")
    return mask


def unpadded_positions(model: nn.Module, inputs: dict[str, Any], mask: Tensor) -> dict[str, Any]:
    """The inputs with the `position_ids` each sequence has alone, where padding precedes real
    tokens (left padding), the model takes position_ids and the batch gives none."""
    if "position_ids" in inputs or "position_ids" not in forward_params(model):
        return inputs
    real = mask.long()
    positions = (real.cumsum(-1) - 1).masked_fill(real == 0, 1)  # transformers' generate
    plain = torch.arange(mask.shape[-1], device=mask.device).expand_as(positions)
    if bool(((positions != plain) & (real == 1)).any()):
        return {**inputs, "position_ids": positions}
    return inputs
