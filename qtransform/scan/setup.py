"""What every scan on calibration data starts from: one policy, one calibration spec, one setup.

The activation scan, the fault scans (gain, kurtosis, instability), the sequential scan and the
per-site sensitivity all begin the same way: turn a policy or a bare format name into a `Policy`,
transform a copy of the model under it, turn the calibration data into padding-free batches
checked against the model, and put the batches where the model is. `prepare_scan` does that once
and returns a `ScanSetup`; the scans differ only in what they measure afterwards.

A policy from a format and options (`scan_policy`) is library work the CLI calls as well: the
command line's `--format`, `--policy`, the format options and `--activations` (W4A4) mean exactly
what `scan_policy` says, from Python too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qtransform import formats
from qtransform.calibration import Calibration, CalibrationSpec
from qtransform.core.program import Program
from qtransform.core.sites import discover_sites
from qtransform.errors import UserError
from qtransform.passes import FakeQuantPass, InstrumentPass
from qtransform.pipeline import plan, transform_program
from qtransform.pipeline.transform import static_rules
from qtransform.schemas import InstrumentSpec, Policy, PolicyLike, dump_policy, load_policy
from qtransform.schemas.base import ATTENTION_TENSORS

MEASURED_TOKENS = 1024  # the automatic stride keeps at least this many tokens when it can
MAX_AUTO_STRIDE = 16  # taps within ~1.5x of the forward (docs/benchmarks.md)
W4A4_TENSORS = ["weight", "input"]


# -- policies ------------------------------------------------------------------------------------
def format_policy(model: nn.Module, fmt: str, options: dict[str, Any] | None = None) -> Policy:
    """What a bare format name means: W4A16-style weight quantization of every linear site except
    the LM head (which quantization recipes keep in high precision), with `options` (block_size,
    scale_rule, rounding, nvfp4_variant) set on the rule."""
    heads = [s.name for s in discover_sites(model).values() if s.role == "lm_head"]
    rule = {"name": fmt, "targets": ["Linear"], "ignore": heads, "format": fmt,
            "tensors": ["weight"], **(options or {})}
    return load_policy({"version": 1, "quantize": [rule]})


def is_format_name(value: object) -> bool:
    """A string that names a format rather than a policy file (an existing path is a file)."""
    return isinstance(value, str) and (value.lower() in formats.names() or not Path(value).exists())


def scan_policy(model: nn.Module, fmt: str | None = None, policy: PolicyLike | None = None, *,
                options: dict[str, Any] | None = None, activations: bool = False) -> Policy:
    """The policy a scan runs from a format and/or a policy, as the CLI's options mean them.

    Without `policy`, `fmt` means `format_policy` (W4A16 on every linear site but the LM head);
    with one, its quantize rules select the sites and `fmt` (when given) replaces their format.
    `options` (block_size, scale_rule, ...) go on every rule; `activations=True` quantizes each
    selected Linear site's input as well as its weight (W4A4; attention rules stay as given).
    """
    if policy is not None and fmt is None and not options and not activations:
        return load_policy(policy)
    if policy is None:
        if fmt is None:
            raise UserError("give a format (e.g. mxfp4) or a policy with quantize rules")
        data = dump_policy(format_policy(model, fmt, options))
    else:
        data = dump_policy(load_policy(policy))
        for rule in data["quantize"]:
            rule.update({"format": fmt} if fmt else {}, **(options or {}))
    if activations:  # a Linear rule's weight and input; an attention rule's tensors stay
        for rule in data["quantize"]:
            if not set(rule.get("tensors") or ()) & set(ATTENTION_TENSORS):
                rule["tensors"] = list(W4A4_TENSORS)
    return load_policy(data)


def as_policy(model: nn.Module, policy_or_format: PolicyLike, *, activations: bool = False) -> Policy:
    """A Policy (or dict, or path) as given, or the policy a format name means (`scan_policy`)."""
    if is_format_name(policy_or_format):
        return scan_policy(model, policy_or_format, activations=activations)
    return scan_policy(model, None, policy_or_format, activations=activations)


def resolve_policy(model: nn.Module, policy_or_format: PolicyLike) -> Policy:
    """A Policy (or format name) with an instrument section; without one, every quantized site
    is instrumented at every point."""
    policy = as_policy(model, policy_or_format)
    if policy.instrument is not None:
        return policy
    rows = [r for r in plan(model, policy).rows if r.pass_name == FakeQuantPass.name]
    quantized = list(dict.fromkeys(r.site for r in rows))
    if not quantized:
        raise UserError("the policy quantizes nothing and has no instrument section: "
                        "nothing to scan")
    exact = [f"re:{re.escape(name)}" for name in quantized]
    attention = [p for p in ATTENTION_TENSORS if any(r.point == p for r in rows)]  # quantized ones
    spec = InstrumentSpec(targets=exact, points=[*InstrumentSpec().points, *attention])
    return policy.model_copy(update={"instrument": spec})


# -- models --------------------------------------------------------------------------------------
def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model that predicts the next token (gets loss and perplexity)."""
    from transformers.models.auto.modeling_auto import (  # not at `import qtransform` (0.8 s)
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def primary_output(output: object) -> Tensor:
    """Logits, else the last hidden state, else the first output."""
    if isinstance(output, Tensor):
        return output
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, Tensor):
            return value
    return output[0]  # type: ignore[index]  (a tuple or list of outputs)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """The full-precision model in eval mode (no dropout) while scanning, then as it was: every
    submodule gets its own `training` flag back (a model may be in train mode with, say, frozen
    norms in eval mode, and `model.train(flag)` would flatten that)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        yield model.eval()
    finally:
        for module, training in flags:
            module.training = training


def placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a model computes and in which float dtype: its first real floating parameter's (a
    skeleton on meta, as the sequential scan builds, computes on the CPU)."""
    for p in model.parameters():
        if p.is_floating_point() and p.device.type != "meta":
            return p.device, p.dtype
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return torch.device("cpu"), dtypes[0] if dtypes else torch.get_default_dtype()


# -- calibration ---------------------------------------------------------------------------------
def tokens(batches: list[Tensor]) -> int:
    """Token positions in the batches (rows of a float input of a plain model)."""
    return sum(b.numel() // b.shape[-1] if b.is_floating_point() else b.numel() for b in batches)


def auto_stride(tokens: int) -> int:
    """Every token of a small calibration set (exact, and cheap in absolute terms); large sets
    sample up to every 16th token, keeping at least `MEASURED_TOKENS` of them."""
    return max(1, min(MAX_AUTO_STRIDE, tokens // MEASURED_TOKENS))


# -- the setup -----------------------------------------------------------------------------------
@dataclass
class ScanSetup:
    """A scan ready to run: the full-precision model (left as it was), the policy, the program of
    the transformed copy, the sites the scan measures, and the calibration batches on the
    model's device."""

    model: nn.Module
    policy: Policy
    program: Program
    sites: list[str]  # instrumented sites in order; with instrument=False, the quantized ones
    calibration: CalibrationSpec
    batches: list[Tensor]
    device: torch.device
    dtype: torch.dtype

    @property
    def quant(self) -> nn.Module:
        """The transformed copy."""
        return self.program.module()

    @property
    def causal(self) -> bool:
        return is_causal_lm(self.model)

    def stride(self, token_stride: int | None) -> int:
        """The token stride to measure with: as given, else `auto_stride` of the batches."""
        return auto_stride(tokens(self.batches)) if token_stride is None else token_stride

    def calibration_meta(self, **extra: Any) -> dict[str, Any]:
        return self.calibration.meta(self.batches, **extra)

    def site_modules(self) -> dict[str, str]:
        """Where each measured site's output is observed: its module (an experts site: its
        experts module, whose one forward call runs both of its matmuls)."""
        return {s: self.program.sites[s].module_name for s in self.sites}


def prepare_scan(model: nn.Module, policy_or_format: PolicyLike, calib: CalibrationSpec | Calibration, *,
                 instrument: bool = True, activations: bool = False) -> ScanSetup:
    """The common prologue of every scan on calibration data (see the module docstring).

    `instrument=True`: the policy gets an instrument section when it has none (`resolve_policy`)
    and `sites` are the instrumented ones; False: the policy is used as it is and `sites` are
    the quantized ones (the sensitivity switches quantizers, it reads no taps). `activations`:
    a format name means W4A4, and a policy's rules quantize inputs too (`scan_policy`).
    """
    spec = CalibrationSpec.of(calib)
    policy = as_policy(model, policy_or_format, activations=activations)
    if instrument:
        policy = resolve_policy(model, policy)
    device, dtype = placement(model)
    batches = spec.batches(model, device, dtype)
    # static scales calibrate on the scan's own batches (the full-precision forward)
    program = transform_program(model, policy, calibration=batches if static_rules(policy) else None)
    kind = InstrumentPass.name if instrument else FakeQuantPass.name
    sites = list(dict.fromkeys(i.site for i in program.insertions(pass_name=kind)))
    return ScanSetup(model, policy, program, sites, spec, batches, device, dtype)
