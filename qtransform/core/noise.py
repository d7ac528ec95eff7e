"""The noise contract: the base class of every inserted noise module, and its counters.

A *noise module* (`NoiseModule`) is what a noise pass inserts. Subclassing it is the whole
contract the controller (`rl/noise.py`: step, disable, state, counters) and the ONNX export
(`noise:<site>/<point>` inputs through `noise_override`) rely on: they find every instance by
this base class, never by a list of classes, so a new noise pass cannot be forgotten by either.
What a module computes is its noise kind's formula (`core/noise_kinds.py`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor, nn

from qtransform.core import ops
from qtransform.core.noise_kinds import noise_kind
from qtransform.core.phase import PHASES, active, in_sync
from qtransform.core.streams import DrawStream


# -- counters ----------------------------------------------------------------------------------
@dataclass
class NoiseCounts:
    """What a noise module saw: forwards and rollout-weight syncs, and whether noise was in them.

    Kept so that a run that configured noise and never applied it can say why (`rl.noise`'s
    `silent_reason`): the step never reached a noisy interval, no call at a noisy step ran in the
    noise's phase, or the noise was switched off."""

    forwards: int = 0
    syncs: int = 0
    noised_forwards: int = 0
    noised_syncs: int = 0
    at_noisy_steps: int = 0  # calls while the scale was > 0
    in_phase_at_noisy_steps: int = 0  # ... of those, calls in the noise's phase
    last_step: int = -1  # the highest step at which a call came
    sigmas: dict[float, int] = field(default_factory=dict)  # scale -> noised calls at it
    held: bool = False  # the step was fixed for a one-shot run: no loop was expected to step it

    def record(self, step: int, sigma: float, in_phase: bool, enabled: bool) -> None:
        sync = in_sync()
        self.syncs += sync
        self.forwards += not sync
        self.last_step = max(self.last_step, step)
        if sigma > 0:
            self.at_noisy_steps += 1
            self.in_phase_at_noisy_steps += in_phase
            if in_phase and enabled:
                self.noised_syncs += sync
                self.noised_forwards += not sync
                self.sigmas[sigma] = self.sigmas.get(sigma, 0) + 1


# -- the module contract ----------------------------------------------------------------------------
LIVE_NOISE: weakref.WeakSet[NoiseModule] = weakref.WeakSet()  # for the end-of-run check of rl.noise
NOISE_MODULES: dict[str, type[NoiseModule]] = {}  # pass name -> its module class


class NoiseModule(nn.Module):
    """An inserted module that noises the value it sits on with one registered kind.

    Subclasses set `noise_pass` (the pass that inserts them; the key of the counters) and give
    `scale()` (the scale now, before phase and switch) and may refine `draw(x)` (default: a fresh
    draw of the kind's distribution per forward from the module's stream). The base does the
    rest the same way for every noise: the phase (`apply_during`), the switch (`enabled`), the
    explicit draw (`noise_override`: the ONNX exporter feeds a graph input through it), the
    counters, the stream's step (`set_step`), and one `qtransform::noise` node when traced.
    """

    noise_pass: ClassVar[str]
    # draw on the CPU and move the draw, so every device gets the same bits (CPU and CUDA
    # generators are different streams): for weight-sized draws, where the copy is cheap
    portable_draws: ClassVar[bool] = False
    # normal draws from the counter-based Gaussian stream (`DrawStream.counter_normal`: the same
    # bits on every device, drawn and applied in one compiled pass on CPU) instead of a seeded
    # torch.Generator: for activation-sized draws, one per output element and forward
    counter_draws: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Checked when the class is defined (at import): the parts the controller and the
        export call must be there, and one pass has one noise module class."""
        super().__init_subclass__(**kwargs)
        name = getattr(cls, "noise_pass", None)
        if not isinstance(name, str) or cls.scale is NoiseModule.scale:
            raise TypeError(f"{cls.__name__}: a NoiseModule names the pass that inserts it "
                            "(noise_pass = '<pass name>') and defines scale()")
        if "noise_pass" in cls.__dict__:
            known = NOISE_MODULES.get(name, cls)
            if (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
                raise TypeError(f"{cls.__name__}: pass {name!r} has a noise module already ({known.__name__})")
            NOISE_MODULES[name] = cls

    def __init__(self, kind: str, label: str, *, seed: int, stream_key: str, apply_during: str):
        super().__init__()
        if apply_during not in PHASES:
            raise ValueError(f"apply_during {apply_during!r} is not one of {', '.join(PHASES)}")
        self.kind = noise_kind(kind).name
        self.label = label
        self.apply_during = apply_during
        self.enabled = True
        self.noise_override: Tensor | None = None
        # set by the graph it is inserted into (`GraphSite.recompile`): x is the fresh result of
        # a compute op that this module alone uses, so the noise may be written into it
        self.owns_input = False
        self.stream = DrawStream(seed, stream_key)
        self.counts = NoiseCounts()
        LIVE_NOISE.add(self)

    def scale(self) -> float:
        """The noise scale now (sigma at the step, a fixed error scale, a drop rate), before the
        phase and the switch are applied."""
        raise NotImplementedError

    @property
    def step_index(self) -> int:
        return self.stream.step

    def set_step(self, step: int, draws: int = 0) -> None:
        """Go to `step` of the stream (with `draws` of its draws taken, when resuming)."""
        self.stream.set_step(step, draws)

    def sample(self, shape: torch.Size, like: Tensor, index: int | None) -> Tensor:
        """Draw `index` of the current step in the kind's distribution, fp32, on like's device
        (drawn on the CPU first with `portable_draws`)."""
        draw = noise_kind(self.kind).draw
        if self.counter_draws and draw == "normal":
            return self.stream.counter_normal(shape, like.device, index)
        device = torch.device("cpu") if self.portable_draws else like.device
        return self.stream.sample(draw, shape, device, index).to(like.device)

    def draw(self, x: Tensor) -> Tensor:
        """The eager draw for this forward: fresh each forward, replayed under recompute."""
        return self.sample(x.shape, x, self.stream.next_index(self.training))

    def traced_draw(self, x: Tensor) -> Tensor:
        """The draw a traced graph is built with when no explicit one is given."""
        if noise_kind(self.kind).draw == "normal":
            return torch.randn_like(x, dtype=torch.float32)
        return torch.rand_like(x, dtype=torch.float32)

    def _may_overwrite(self, x: Tensor) -> bool:
        """Whether this call may write into x, which the graph says is ours (`owns_input`): no
        hook could have kept it, and it is one contiguous block (the compiled pass's layout)."""
        return _no_hooks(self) and x.is_contiguous()

    def forward(self, x: Tensor) -> Tensor:
        in_phase = active(self.apply_during, self.training)
        scale = self.scale() if in_phase and self.enabled else 0.0
        z = self.noise_override
        if ops.is_tracing(x):
            return torch.ops.qtransform.noise(x, self.traced_draw(x) if z is None else z, scale, self.kind,
                                              self.label)
        self.counts.record(self.stream.step, self.scale(), in_phase, self.enabled)
        if scale == 0.0:
            return x
        kind = noise_kind(self.kind)
        recorded = x.requires_grad and torch.is_grad_enabled()
        inplace = self.owns_input and not recorded and self._may_overwrite(x)
        if (z is None and self.counter_draws and kind.draw == "normal" and x.dtype == torch.float32
                and kind.name in ("add", "relative") and type(self).draw is NoiseModule.draw and not recorded):
            # draw and formula in one pass, the bits of `kind.apply` on the same draw
            return self.stream.counter_normal(x.shape, x.device, self.stream.next_index(self.training),
                                              x, kind.name, scale, inplace)
        if z is None and type(self).draw is NoiseModule.draw:  # the stream's draw is ours to overwrite
            if inplace and kind.apply_inplace is not None:
                return kind.apply_inplace(x, self.draw(x), scale)
            if kind.apply_fresh is not None:
                return kind.apply_fresh(x, self.draw(x), scale)
        return kind.apply(x, self.draw(x) if z is None else z, scale)


def _no_hooks(module: nn.Module) -> bool:
    """No hook of this module or of every module (torch's global ones) can hold its input."""
    return not (module._forward_pre_hooks or module._forward_hooks
                or nn.modules.module._global_forward_pre_hooks or nn.modules.module._global_forward_hooks)


def noise_modules(model: nn.Module) -> list[NoiseModule]:
    """Every noise module of a transformed model, in module order."""
    return [m for m in model.modules() if isinstance(m, NoiseModule)]
