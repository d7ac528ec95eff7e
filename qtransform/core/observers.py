"""Observers: how calibration batches become a static tensor-level scale, and that scale frozen.

The three observers are llm-compressor 0.14's (`llmcompressor/observers/min_max.py`), with its
statistics: per call, the min and max of each group of the observed activation (rows = tokens,
groups = the format's blocks along the last axis, or the whole row for a single scale), kept in
the activation's dtype; the tensor-level amax is then `max(max(max_vals, 0), -min(min_vals, 0))`
over the groups (compressed-tensors' `generate_gparam`).

- `static_minmax`: the min of the mins and the max of the maxes over every call;
- `minmax`: a moving average, `old * (1 - c) + new * c` per group (c = `averaging_constant`,
  0.01 by default; the first call's values as they are);
- `memoryless_minmax`: the last call's values.

Per group matters only for the moving average: the min of all mins is the min either way, so
`static_minmax` and `memoryless_minmax` keep one min and max per call (`torch.aminmax`, one
pass), which gives the same amax bit for bit at a fraction of the cost.
`StaticScale` holds one observer while the model is calibrated and the frozen amax afterwards, as
a non-persistent buffer: it moves with `.to()`, is not a parameter (an optimizer never sees it,
noise never writes it), and leaves `state_dict()` keys unchanged; `save_transformed` writes it
beside the weights. Opened from a quantized checkpoint, it holds the checkpoint's stored scale
instead (`StoredScale`: NVFP4's global scale, an FP8 input scale), which the fake-quant uses as
it is: an amax reconstructed from it would give the stored scale back only up to rounding
(llm-compressor rounds a bf16 model's g = 2688/amax to bf16, and 2688/g gives that model another
g). While `collecting()` is on (`qtransform.calibration.calibrate`), every fake-quant passes
its tensor through unquantized: both llm-compressor (its sequential pipeline runs under
`DisableQuantization`) and ModelOpt calibrate on the full-precision activations.

Observers see real tokens only: llm-compressor calibrates on unpadded samples, so a padded
batch must give the statistics of its sequences one by one. The calibration run puts each
batch's attention mask here (`real_tokens`); an observed tensor keeps the rows of positions
where the mask is 1 (`real_rows`): a [batch, tokens, ...] tensor by its two leading dims, a
[batch * tokens, features] one by its rows, and a fused experts module's rows (token rows
repeated top_k times and grouped by expert) by the token each row came from (`route`, noted by
its dispatch). A tensor whose rows cannot be mapped to token positions is refused while the
mask has padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qtransform.errors import UserError

OBSERVERS = ("static_minmax", "minmax", "memoryless_minmax")
_collecting = False
# the statistics of the last observed tensor: q/k/v (and gate/up) observe one input tensor, so
# it is reduced once (kept by identity and version, so a tensor written in place is read again)
_last: tuple[Tensor, int, int, bool, tuple[Tensor, Tensor] | None] | None = None
# the current calibration batch's real tokens ([batch, tokens] bool), None when all are real
_mask: Tensor | None = None
# for the rows of the experts module running now: whether each row's token is real (None: the
# module's tokens did not match the mask)
_routed: Tensor | None = None


def collecting() -> bool:
    """Whether a calibration run is going on (fake-quants pass tensors through and observe)."""
    return _collecting


@contextlib.contextmanager
def collect() -> Iterator[None]:
    """The span of a calibration run."""
    global _collecting, _last
    before, _collecting = _collecting, True
    try:
        yield
    finally:
        _collecting, _last = before, None


@contextlib.contextmanager
def real_tokens(mask: Tensor | None) -> Iterator[None]:
    """The span of one calibration batch whose attention mask is `mask` ([batch, tokens], 1 at
    real tokens; None or all ones: every position is real)."""
    global _mask, _routed, _last
    _mask = None if mask is None or bool(mask.all()) else mask.bool()
    _routed, _last = None, None
    try:
        yield
    finally:
        _mask, _routed, _last = None, None, None


def route(token_of_row: Tensor, tokens: int) -> None:
    """An experts module's dispatch: row r of its grouped tensors holds token `token_of_row[r]`
    of its `tokens` flattened [batch * tokens] inputs."""
    global _routed
    if _mask is not None:
        flat = _mask.reshape(-1)
        _routed = flat[token_of_row.to(flat.device)] if flat.numel() == tokens else None


def real_rows(x: Tensor, routed: bool = False) -> Tensor:
    """The rows of `x` at real tokens (x itself when every position is real); `routed`: x is an
    experts module's grouped tensor (`route`). A tensor whose rows are not token positions of
    the batch is refused, as calibrating on its padding would be wrong."""
    if _mask is None:
        return x
    shape = tuple(_mask.shape)
    if routed:
        if _routed is not None and x.ndim >= 1 and x.shape[0] == _routed.numel():
            return x[_routed.to(x.device)]
    elif x.ndim >= 3 and tuple(x.shape[:2]) == shape:
        return x[_mask.to(x.device)]
    elif x.ndim == 2 and x.shape[0] == _mask.numel():
        return x[_mask.reshape(-1).to(x.device)]
    raise UserError(f"a tensor of shape {tuple(x.shape)} has no token positions of the "
                    f"attention_mask {list(shape)}: calibrate its static scale on batches "
                    "without padding (no attention_mask, or all ones)")


def group_min_max(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Per-group min and max of x over its rows: groups of `group` elements along the last axis
    (zero-padded, as the format's blocks are), or the whole row when `group` is 0."""
    rows = x.detach().reshape(-1, x.shape[-1] if x.ndim else 1)
    width = rows.shape[-1]
    if group and width % group:
        rows = torch.nn.functional.pad(rows, (0, group - width % group))
    grouped = rows.reshape(rows.shape[0], -1, group) if group else rows.reshape(rows.shape[0], 1, -1)
    lo, hi = torch.aminmax(grouped, dim=-1)  # the contiguous axis first, then the tokens
    return lo.amin(dim=0), hi.amax(dim=0)


def _statistics(x: Tensor, group: int, routed: bool = False) -> tuple[Tensor, Tensor] | None:
    """Per-group min and max (`group_min_max`), or with `group` -1 the tensor's min and max, of
    x's real rows (`real_rows`); None when it has none."""
    global _last
    if (_last is not None and _last[0] is x and _last[1] == x._version and _last[2] == group
            and _last[3] == routed):
        return _last[4]
    rows = real_rows(x, routed)
    stats = None if rows.numel() == 0 else (
        group_min_max(rows, group) if group >= 0 else torch.aminmax(rows.detach()))
    _last = (x, x._version, group, routed, stats) if _collecting else None
    return stats


class Observer:
    """Statistics of the calls seen so far; `amax()` is the tensor-level amax they give."""

    name = ""
    per_group = False  # whether the statistics must be kept per group (the moving average)

    def __init__(self, group: int, averaging_constant: float = 0.01):
        self.group = group
        self.averaging_constant = averaging_constant
        self.min_vals: Tensor | None = None
        self.max_vals: Tensor | None = None
        self.calls = 0

    def observe(self, x: Tensor, routed: bool = False) -> None:
        """One call's statistics, of x's real tokens (`real_rows`)."""
        if x.numel() == 0:
            return
        stats = _statistics(x, self.group if self.per_group else -1, routed)
        if stats is None:
            return
        lo, hi = stats
        if self.min_vals is not None and self.min_vals.shape != lo.shape:
            raise ValueError(f"observed a tensor of {x.shape[-1]} features after one of another "
                             "width: one static scale per tensor of one shape")
        self.min_vals, self.max_vals = self.update(lo, hi)
        self.calls += 1

    def update(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def amax(self) -> Tensor:
        """max(max(max_vals, 0), -min(min_vals, 0)) over the groups, as a 0-dim fp32 tensor."""
        if self.min_vals is None or self.max_vals is None:
            raise ValueError("no calibration data reached this tensor")
        lo = torch.clamp_max(self.min_vals, 0).abs().amax()
        hi = torch.clamp_min(self.max_vals, 0).amax()
        return torch.maximum(lo, hi).to(torch.float32).reshape(())


class StaticMinMax(Observer):
    name = "static_minmax"

    def update(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
        if self.min_vals is None or self.max_vals is None:
            return lo, hi
        return torch.min(lo, self.min_vals), torch.max(hi, self.max_vals)


class MinMax(Observer):
    name = "minmax"
    per_group = True

    def update(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
        if self.min_vals is None or self.max_vals is None or self.averaging_constant == 1.0:
            return lo, hi
        c = self.averaging_constant
        return self.min_vals * (1.0 - c) + lo * c, self.max_vals * (1.0 - c) + hi * c


class MemorylessMinMax(Observer):
    name = "memoryless_minmax"

    def update(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
        return lo, hi


_CLASSES: dict[str, type[Observer]] = {c.name: c for c in (StaticMinMax, MinMax, MemorylessMinMax)}


def make_observer(name: str, group: int, averaging_constant: float = 0.01) -> Observer:
    """An observer by llm-compressor's name."""
    if name not in _CLASSES:
        raise ValueError(f"unknown observer {name!r}; observers: {', '.join(OBSERVERS)}")
    return _CLASSES[name](group, averaging_constant)


@dataclass(frozen=True)
class StoredScale:
    """A tensor-level scale as a checkpoint stores it, in the format's own terms (`fake_quantize`'s
    scale=: NVFP4's global scale g for compressed-tensors, its decode scale d for ModelOpt, the
    per-tensor scale of FP8 and integers), to be used as it is."""

    value: Tensor


class StaticScale(nn.Module):
    """One calibrated, frozen tensor-level amax (NVFP4's global scale comes from it), or a
    checkpoint's stored tensor-level scale (`scale`, when `stored`).

    Before calibration `amax` is NaN and `frozen` False; `calibrate` resets the observer, feeds it
    every batch, then freezes. The value stays until the next calibration or `load`.
    """

    def __init__(self, observer: str, group: int, averaging_constant: float = 0.01, *,
                 routed: bool = False, tensor: str = "input"):
        super().__init__()
        self.routed = routed  # observes an experts module's grouped rows (`real_rows`)
        self.tensor = tensor  # the site tensor it scales ("input", "key", "value", ...)
        self.observer_name = observer
        self.group = group
        self.averaging_constant = averaging_constant
        self.register_buffer("amax", torch.tensor(float("nan")), persistent=False)
        self.register_buffer("scale", torch.tensor(float("nan")), persistent=False)
        self.frozen = False
        self.stored = False  # the value is `scale` (a checkpoint's), not `amax`
        self._observer: Observer | None = None

    def extra_repr(self) -> str:
        if not self.frozen:
            value = "not calibrated"
        elif self.stored:
            value = f"stored scale={self.scale.item():.6g}"
        else:
            value = f"amax={self.amax.item():.6g}"
        return f"{self.observer_name}, {value}"

    def start(self) -> None:
        """A new calibration: statistics from nothing."""
        self._observer = make_observer(self.observer_name, self.group, self.averaging_constant)

    def observe(self, x: Tensor) -> None:
        if self._observer is None:
            self.start()
        assert self._observer is not None
        self._observer.observe(x, self.routed)

    @property
    def calls(self) -> int:
        return 0 if self._observer is None else self._observer.calls

    def freeze(self) -> None:
        """The observer's amax becomes the scale; the statistics go."""
        assert self._observer is not None
        self.load(self._observer.amax())
        self._observer = None

    def load(self, value: Tensor | StoredScale) -> None:
        """Set the frozen amax (calibration's, or a saved one), or a checkpoint's stored scale."""
        stored = isinstance(value, StoredScale)
        tensor = value.value if isinstance(value, StoredScale) else value
        nan = torch.tensor(float("nan"), device=self.amax.device)
        with torch.no_grad():
            tensor = tensor.detach().to(torch.float32, copy=True).reshape(()).to(self.amax.device)
            self.amax, self.scale = (nan, tensor) if stored else (tensor, nan)
        self.frozen, self.stored = True, stored


def static_scales(model: nn.Module) -> dict[str, StaticScale]:
    """Every static scale of a model by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, StaticScale)}
