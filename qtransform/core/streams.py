"""Random draws that are a pure function of (seed, site, step, draw index).

Every random value qtransform injects (AQN draws, hardware error, stochastic rounding inside the
model) comes from here, so a run is reproducible, two ranks of a data-parallel job draw the same
noise for the same step, and the order in which sites or ranks run changes nothing.

Gradient checkpointing runs a forward a second time inside backward; that recomputation must see
the draws of the forward it replays, or the gradients are wrong. A stream remembers the draw
index of each grad-enabled forward of the current step and hands the newest unreplayed one back
when a forward runs inside backward (checkpointed segments are recomputed newest first).
"""

from __future__ import annotations

import hashlib
from collections import deque

import torch

from qtransform.core.sites import hf_name
from qtransform.formats import fastpath, philox

REPLAYABLE = 4096  # forwards of one step a checkpointed backward may still replay
# 1: every normal from a seeded torch.Generator; 2: the normals of modules with counter draws
# (hardware error, Gaussian activation noise) from the Gaussian stream of formats/philox.py
STREAM_VERSION = 2


def site_seed(seed: int, site: str, step: int, index: int | None = None) -> int:
    """A stable 63-bit seed for draw `index` of `site` at `step` (sites get independent streams);
    `index=None` is the step's own draw (AQN's z with resample="step")."""
    key = f"{seed}/{site}/{step}" + ("" if index is None else f"/{index}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def in_backward() -> bool:
    """True while the autograd engine runs (where checkpointed forwards are recomputed)."""
    return torch._C._current_graph_task_id() != -1


def base_key(key: str) -> str:
    """A stream key under the base model's names (`<site>` or `<site>/<point>_<pass>`): PEFT's
    prefix and `base_layer` removed, so a model draws the same noise whichever order PEFT and
    the transform ran in."""
    site, sep, rest = key.partition("/")
    return hf_name(site) + sep + rest


class DrawStream:
    """The draws of one site: `seed(…)` / `normal(…)` for the next forward of the current step.
    Keyed on the base model's name of the site (`base_key`)."""

    def __init__(self, seed: int, key: str):
        self.seed = seed
        self.key = base_key(key)
        self.step = 0
        self.count = 0  # draws taken by forwards of this step
        self._replay: deque[int] = deque(maxlen=REPLAYABLE)  # forwards a recompute may replay
        self._generators: dict[torch.device, torch.Generator] = {}

    def set_step(self, step: int, count: int = 0) -> None:
        """Go to `step` (with `count` of its draws already taken, when resuming a checkpoint)."""
        self.step, self.count = step, count
        self._replay.clear()

    def next_index(self, training: bool = False) -> int:
        """The draw index for this forward: a fresh one, or the replayed one under recompute.

        A forward may be replayed if it builds a graph, or if it runs in training mode without
        one (reentrant checkpointing runs the first forward under no_grad); at most
        `REPLAYABLE` recent forwards are remembered."""
        if in_backward() and self._replay:
            return self._replay.pop()
        index, self.count = self.count, self.count + 1
        if torch.is_grad_enabled() or training:
            self._replay.append(index)
        return index

    def seed_at(self, index: int | None) -> int:
        return site_seed(self.seed, self.key, self.step, index)

    def generator(self, device: torch.device, index: int | None) -> torch.Generator:
        """A generator on `device` positioned at draw `index` of this step (one per device)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen.manual_seed(self.seed_at(index))

    def sample(self, distribution: str, shape: torch.Size, device: torch.device, index: int | None) -> torch.Tensor:
        """Draw `index` of this step on `device`: standard normal or uniform on [0, 1), in fp32
        whatever the default dtype (a noise kind casts it where its formula says)."""
        sampler = {"normal": torch.randn, "uniform": torch.rand}[distribution]
        return sampler(shape, generator=self.generator(device, index), device=device, dtype=torch.float32)

    def counter_normal(self, shape: torch.Size, device: torch.device, index: int | None,
                       x: torch.Tensor | None = None, op: str = "draw", scale: float = 0.0,
                       inplace: bool = False) -> torch.Tensor:
        """Draw `index` of this step from the counter-based Gaussian stream (formats/philox.py:
        Philox4x32-10 keyed by the draw's seed, the element's position as counter), fp32, the
        same bits on every device; with `op` "add" or "relative", x + scale*z or x*(1 + scale*z)
        instead (fp32 x), drawn and applied in one compiled pass where the CPU kernel runs;
        `inplace` writes that result into x (contiguous, no one else's), the same bits."""
        seed = self.seed_at(index)
        if device.type == "cpu":
            out = fastpath.normal(seed, tuple(shape), x, op, scale, inplace)
            if out is not None:
                return out
        z = philox.normal(seed, tuple(shape), device)
        if op == "draw":
            return z
        if inplace:
            return x.add_(z.mul_(scale)) if op == "add" else x.mul_(z.mul_(scale).add_(1))
        return x + z.mul_(scale) if op == "add" else x * z.mul_(scale).add_(1)
