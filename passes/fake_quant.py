"""Fake-quant pass: quantize-dequantize the weights, inputs or outputs of selected sites.

Driven by the policy's ordered `quantize` rules; a later rule overrides an earlier one for the
same (site, tensor). Weights are quantized once and cached until the parameter changes
(`core.versions.Watch`: a forward with unchanged weights reads none of them), so a forward costs
what the original model costs; under FSDP the weight is quantized in every forward and nothing
is kept (a cached copy would be the unsharded weight on every rank).

Tensor-level scales (NVFP4's global scale) come from the tensor itself, unless the rule says
otherwise: a weight in a scale group (`share_scale`) takes the group's amax (`core.scales`), an
activation takes one amax per token row (`global_scale` "token", the default), the whole call's
("tensor") or a calibrated, frozen one (`scale_source` "static", `core.observers`). A static
scale opened from a quantized checkpoint holds the stored tensor-level scale itself, which goes to
`fake_quantize` as its `scale=`, as the checkpoint's library uses it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qtransform import formats
from qtransform.core import ops
from qtransform.core.backward import BackwardLinear, BackwardSpec
from qtransform.core.observers import StaticScale, collecting
from qtransform.core.phase import in_rollout
from qtransform.core.program import Program
from qtransform.core.scales import ScaleGroup
from qtransform.core.sharding import sharded
from qtransform.core.sites import ATTENTION_KIND, Site
from qtransform.core.streams import DrawStream
from qtransform.core.versions import Watch, recheck
from qtransform.errors import UserError
from qtransform.formats import QuantConfig
from qtransform.formats.quantize import check_fits
from qtransform.formats.stored import scale_of, stored_input_scale
from qtransform.pipeline.base import Action, Pass, register_pass
from qtransform.pipeline.selection import resolve_quantize, share_groups
from qtransform.schemas import QuantRule
from qtransform.schemas.sections.quantize import activation_global_scale, observer_name


def weight_label(site: str) -> str:
    """The label of a site's weight fake-quant (its stream key and its node name in exports)."""
    return FakeQuantPass.label(site, "weight")


def expert_seed(seed: int, expert: int) -> int:
    """Expert `expert`'s stream seed when a fused experts weight is quantized expert by expert."""
    return (seed + expert) % 2**63


def first_weight_seed(config: QuantConfig, site: str, expert: int | None = None) -> int | None:
    """The stochastic-rounding seed the transformed model's first forward uses for this site's
    weight (expert): what a weight scan draws, so that it measures that very tensor. None for
    deterministic rounding."""
    if not config.stochastic:
        return None
    seed = DrawStream(config.seed or 0, weight_label(site)).seed_at(0)
    return seed if expert is None else expert_seed(seed, expert)


class _CachedSTE(torch.autograd.Function):
    """Returns the cached quantized weight; the gradient goes straight to the parameter."""

    @staticmethod
    def forward(ctx, weight: Tensor, quantized: Tensor) -> Tensor:  # noqa: ARG004
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class FakeQuantize(nn.Module):
    """Quantize-dequantize one tensor of a site in one format.

    On a weight (`cache=True`) the quantized copy is kept and reused while the parameter is
    unchanged (`core.versions.Watch`: a sample of the weight per forward outside rollouts, every
    byte at a rollout's entry and after `train()` / `eval()`; docs/rl.md says which writes are
    seen when). Under FSDP (`core.sharding.sharded`) there
    is no cache: the weight arrives all-gathered for this forward only, and a copy kept past the
    forward would be a full-size tensor on every rank. Under torch.export/compile the
    module emits the `qtransform::fake_quant` op, labelled `<site>/<tensor>_fake_quant`.

    With `per_expert` (a fused experts weight [E, ...]) each expert's matrix is quantized on its
    own, exactly as that matrix would be as an nn.Linear weight (`axis` is the axis of each
    matrix; NVFP4's tensor scale is one per expert); traced, that is one op per expert labelled
    `<label>.expert<e>` where the whole tensor at once would differ (a tensor scale, stochastic
    rounding), and one op otherwise.
    """

    def __init__(self, config: QuantConfig, label: str, *, cache: bool = False,
                 per_expert: bool = False, lora: str = "beside", global_scale: str | None = None,
                 static_scale: StaticScale | None = None, group: ScaleGroup | None = None,
                 fixed_scale: float | None = None, heads_first: bool = False):
        super().__init__()
        # where the tensor-level amax comes from: None = the tensor's own, "token" = per row,
        # "static" = `static_scale` (calibrated), "group" = `group` (a shared weight scale),
        # "fixed" = `fixed_scale` (a scale an engine is given, used as it is)
        self.global_scale = "static" if static_scale is not None else (
            "group" if group is not None else "fixed" if fixed_scale is not None else (
                global_scale if global_scale == "token" else None))
        self.static_scale = static_scale
        self.fixed_scale = fixed_scale
        # the fixed scale as the tensor `fake_quantize` takes, made once (not at every call)
        self._fixed_scale = None if fixed_scale is None else torch.tensor(fixed_scale, dtype=torch.float32)
        self.heads_first = heads_first  # an attention tensor [batch, heads, tokens, head_dim]
        self.group = group
        self._group_version = -1
        self._pinned: list[dict] | None = None  # `pin_amax`: the fixed value(s) a trace carries
        self.lora = lora  # how a LoRA adapter on this weight combines with it (core/lora.py)
        self.per_expert = per_expert
        self.config = config.bind(-1)  # an unbound axis means the last dim, as in fake_quantize
        self.label = label
        self.cache = cache and not config.stochastic
        # stochastic rounding: one draw per forward from the stream of the config's seed
        self.stream = DrawStream(config.seed or 0, label) if config.stochastic else None
        self._watch = Watch()
        self._cached: Tensor | None = None
        self.enabled = True  # eager only: off, the tensor passes unchanged (per-site sensitivity)

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.config.options().items())
        scale = f", global_scale={self.global_scale}" if self.global_scale else ""
        return f"{self.config.name}, {opts}{scale}, label={self.label!r}"

    @property
    def enabled(self) -> bool:
        """Eager only: off, the tensor passes unchanged (per-site sensitivity, parity)."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = on
        recheck()  # a cached copy armed for a rollout block is not used past a switch

    def set_step(self, step: int, draws: int = 0) -> None:
        if self.stream is not None:
            self.stream.set_step(step, draws)

    def _expertwise(self) -> bool:
        """Whether quantizing the whole [E, ...] tensor at once could differ from expert by
        expert: a per-tensor scale (NVFP4 two-level) or a stochastic stream."""
        cfg = self.config
        return self.per_expert and (cfg.stochastic or cfg.family.per_tensor(cfg))

    def _tensor_level(self, x: Tensor) -> dict[str, Tensor]:
        """`fake_quantize`'s keyword for the tensor-level scale of `x`: {"amax": ...} replacing
        x's own amax, {"scale": ...} a stored scale, {} x's own amax."""
        if self.global_scale == "token":
            return {"amax": x.detach().abs().amax(dim=self.config.block_axis, keepdim=True)
                    .to(torch.float32)}
        return self._fixed()

    def amax_for(self, x: Tensor) -> Tensor | None:
        """The tensor-level amax this module quantizes `x` with (None: x's own or a stored
        scale): what a checkpoint writer needs to store the same scales."""
        return self._tensor_level(x).get("amax")

    def _fixed(self) -> dict[str, Tensor]:
        """A scale group's amax, a static scale's amax or stored scale (`_tensor_level`'s
        keyword); {} for the other sources."""
        if self.global_scale == "group":
            assert self.group is not None
            return {"amax": self.group.amax(None if sharded(self) else self._check())}
        if self.global_scale == "static":
            static = self.static_scale
            assert static is not None
            if not static.frozen:
                raise UserError(f"{self.label}: its static scale is not calibrated; pass "
                                "calibration=batches to qtransform.transform (CLI: --calib FILE)")
            return {"scale": static.scale} if static.stored else {"amax": static.amax}
        if self.global_scale == "fixed":
            assert self.fixed_scale is not None
            return {"scale": self._fixed_scale}
        return {}

    def fixed_level(self) -> dict[str, Tensor]:
        """The one tensor-level scale this module applies whatever x is: {"scale": ...} (stored
        or fixed), {"amax": ...} (calibrated static, scale group), or {} (x's own, per token,
        or a static scale not calibrated yet)."""
        if self.global_scale in (None, "token") or (self.static_scale is not None and not self.static_scale.frozen):
            return {}  # x's own, or a static scale still calibrating
        return self._fixed()

    @staticmethod
    def _check() -> str:
        return "identity" if in_rollout() else "sample"

    def quantize(self, x: Tensor, amax: Tensor | None = None) -> Tensor:
        """Quantize-dequantize `x` now, without the cache (rollout weights, stochastic draws);
        expert by expert where that differs from the whole tensor (each expert draws seed + e).
        `amax` replaces x's own amax for the tensor-level scale (`fake_quantize`'s `amax`): a
        0-dim tensor, or for per-expert weights one value per expert ([E]); by default the
        module's own source (`global_scale`: per token, static (an amax, or a stored scale),
        the scale group's)."""
        seed = None if self.stream is None else self.stream.seed_at(self.stream.next_index(self.training))
        level = self._tensor_level(x) if amax is None else {"amax": amax}
        if not self._expertwise():
            return formats.fake_quantize(x, self.config, seed=seed, **level)
        key, value = next(iter(level.items()), ("amax", None))
        values = [value] * x.shape[0] if value is None or not value.ndim else value.reshape(-1).unbind()
        return torch.stack([
            formats.fake_quantize(x[e], self.config, seed=None if seed is None else expert_seed(seed, e),
                                  **{key: values[e]})
            for e in range(x.shape[0])])

    def _traced(self, x: Tensor) -> Tensor:
        """One `qtransform::fake_quant` op (one per expert where that differs); a tensor-level
        amax that is not x's own travels in its options (`ops.GLOBAL_KEYS`): per token, or the
        fixed value of a static scale (an amax or a stored scale) or scale group as it stands at
        export time."""
        fmt = self.config.name
        if self.global_scale == "token":
            extra: list[dict] = [{"global_scale": "token"}]
        elif self.global_scale is None:
            extra = [{}]
        else:
            if self._pinned is None:
                raise UserError(f"{self.label}: its {self.global_scale} global scale has no value "
                                "in a trace; call pin_amax() on it first (export_onnx does)")
            extra = self._pinned
        if not self._expertwise():
            return torch.ops.qtransform.fake_quant(x, fmt, ops.op_options(self.config, extra[0]), self.label)
        per = extra if len(extra) == x.shape[0] else extra * x.shape[0]
        return torch.stack([torch.ops.qtransform.fake_quant(x[e], fmt, ops.op_options(self.config, per[e]),
                                                            ops.expert_label(self.label, e))
                            for e in range(x.shape[0])])

    def pin_amax(self) -> None:
        """Read now, eagerly, the fixed tensor-level amax or stored scale (a static scale's, a
        scale group's) that a trace carries as a constant: traced tensors have no values."""
        with torch.no_grad():
            fixed = self._fixed()
        if not fixed:
            self._pinned = None
            return
        (kind, value), = fixed.items()
        key = "tensor_scale" if kind == "scale" else "global_amax"
        self._pinned = [{key: float(v)} for v in value.reshape(-1).tolist()]

    def quantizers(self) -> list[FakeQuantize]:
        """The quantizers this module is made of (itself; a `HeadwiseQuantize` has one per head)."""
        return [self]

    def stored_scale(self, dtype: torch.dtype) -> Tensor:
        """The tensor-level scale of a calibrated or stored static scale as a checkpoint stores
        it (and an engine receives it) for a tensor of `dtype`: FP8's amax / max in the
        format's scale dtype, as 0-dim; what `export_checkpoint` writes as k_scale / v_scale."""
        static = self.static_scale
        if static is None or not static.frozen:
            raise UserError(f"{self.label}: no calibrated static scale; pass calibration=batches "
                            "(CLI: --calib FILE)")
        scale = (stored_input_scale(self.config, static.scale, dtype) if static.stored
                 else scale_of(self.config, static.amax, dtype))[0]
        return scale.reshape(-1)[0]

    def clear_cache(self) -> None:
        """Drop the cached quantized weight (a sequential scan frees each layer after use)."""
        self._watch.forget()
        self._cached = None

    def train(self, mode: bool = True) -> FakeQuantize:
        self._watch.recheck()  # a change of mode is a point where every byte is checked
        if self.group is not None:
            self.group.recheck()
        recheck()  # ... also for a cached copy armed for a rollout block (core/shortcut.py)
        return super().train(mode)

    def quantized_copy(self, x: Tensor) -> Tensor:
        """The quantized copy of `x` without gradient, whether or not the module is enabled."""
        with torch.no_grad():
            return self.quantize(x.detach())

    def forward(self, x: Tensor) -> Tensor:
        if ops.is_tracing(x):
            return self._traced(x)
        if collecting():  # a calibration run: the full-precision model, observed
            if self.static_scale is not None:
                try:  # observed by token rows: an attention tensor's tokens are its third axis
                    self.static_scale.observe(x.transpose(1, 2) if self.heads_first else x)
                except UserError as exc:  # a tensor without token positions: name the site
                    raise UserError(f"{self.label}: {exc}") from None
            return x
        if not self.enabled:
            return x
        if not self.cache or sharded(self):
            self.clear_cache()  # a copy cached before the model was sharded goes
            return self.quantize(x)
        cached = self._current(x)
        if torch.is_grad_enabled() and x.requires_grad:
            if self.config.zero_saturated_grad:
                return self.quantize(x)
            return _CachedSTE.apply(x, cached)
        return cached

    def cached_weight(self, weight: Tensor) -> Tensor | None:
        """What `forward(weight)` returns when that is the cached copy or, switched off, the
        weight itself; None otherwise (no cache, FSDP, a gradient through the weight, a
        calibration run): a site's shortcut (core/shortcut.py) computes with it without calling
        the module."""
        if (not self.cache or sharded(self) or collecting()
                or (weight.requires_grad and torch.is_grad_enabled())):
            return None
        return self._current(weight) if self.enabled else weight

    def _current(self, x: Tensor) -> Tensor:
        """The cached copy of `x`, quantized again if `x` changed since the last call or, in a
        scale group, if a member's change moved the group's amax."""
        regrouped = False
        if self.group is not None:
            self.group.amax(self._check())  # re-reads the members whose weights changed
            regrouped = self.group.version != self._group_version
        if self._watch.changed(x, self._check()) or self._cached is None or regrouped:
            try:
                # a normal tensor even under inference_mode, so that a later training forward
                # can save it for backward (and a rotation's Watch can read its version)
                with torch.inference_mode(False), torch.no_grad():
                    self._cached = self.quantize(x.detach())
                if self.group is not None:
                    self._group_version = self.group.version
            except BaseException:
                self.clear_cache()  # the watch has seen x, the cache has not
                raise
        return self._cached


class HeadwiseQuantize(nn.Module):
    """One scale per head of an attention tensor ([batch, heads, tokens, head_dim]): the
    `FakeQuantize` of each head (`heads[h]`, labelled `<label>.head<h>`) on its slice, as
    compressed-tensors' `attn_head` strategy scales a KV cache."""

    def __init__(self, heads: list[FakeQuantize], label: str):
        super().__init__()
        self.heads = nn.ModuleList(heads)
        self.label = label

    def quantizers(self) -> list[FakeQuantize]:
        return list(self.heads)  # type: ignore[arg-type]

    def stored_scale(self, dtype: torch.dtype) -> Tensor:
        """Each head's stored scale (`FakeQuantize.stored_scale`), 1-D."""
        return torch.stack([quant.stored_scale(dtype) for quant in self.quantizers()])

    @property
    def enabled(self) -> bool:
        """Eager only: the heads are switched together (per-site sensitivity, parity)."""
        return any(quant.enabled for quant in self.heads)

    @enabled.setter
    def enabled(self, on: bool) -> None:
        for quant in self.heads:
            quant.enabled = on

    @property
    def config(self) -> QuantConfig:
        """The format every head quantizes in (one rule builds them all)."""
        return self.heads[0].config

    def quantized_copy(self, x: Tensor) -> Tensor:
        """The quantized copy of `x`, head by head, without gradient, enabled or not."""
        return torch.cat([quant.quantized_copy(x[:, h:h + 1]) for h, quant in enumerate(self.heads)], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[1] != len(self.heads):
            raise UserError(f"{self.label}: {x.shape[1]} heads reached a quantizer built for "
                            f"{len(self.heads)} (one scale per head); the model's config and its "
                            "attention disagree")
        return torch.cat([quant(x[:, h:h + 1]) for h, quant in enumerate(self.heads)], dim=1)


def _tensor_shape(site: Site, point: str) -> tuple[int, ...] | None:
    """The shape (as far as the blocks see it) of a site's weight, or the feature dim of its
    input/output, from the weight's shape (an attention tensor's: its head_dim); None where the
    site has neither."""
    if site.kind == ATTENTION_KIND:
        return (site.heads[2],) if site.heads and point != "probs" else None
    shape = site.weight_shape
    if shape is None or point == "weight" or len(shape) == 1:
        return shape
    red = site.reduction_axis % len(shape)
    other = next(d for d in range(len(shape)) if d not in (red, site.expert_axis))
    return (shape[red] if point == "input" else shape[other],)


def attention_quantizer(site: Site, point: str, rule: QuantRule) -> nn.Module:
    """The quantizer a rule puts on an attention tensor: blocks along head_dim, one scale per
    token and head, per head (`HeadwiseQuantize`) or per tensor; static, dynamic or fixed (the
    pass builds it; an activation scan builds the KV alternatives it measures with it too)."""
    config = rule.config().bind(-1)
    label = FakeQuantPass.label(site.name, point)
    source = activation_global_scale(rule)

    def one(name: str) -> FakeQuantize:
        static = None
        if source == "static":
            observer = observer_name(rule)
            assert observer is not None
            kwargs = rule.observer_kwargs
            static = StaticScale(observer, config.block, kwargs.averaging_constant if kwargs else 0.01,
                                 tensor=point)
        return FakeQuantize(config, name, global_scale=source, static_scale=static,
                            fixed_scale=rule.fixed_scale if source == "fixed" else None,
                            heads_first=True)

    if rule.granularity != "head":
        return one(label)
    if site.heads is None:
        raise UserError(f"{site.name}: its config does not give its number of heads, which "
                        'granularity "head" needs; use "tensor" or "token"')
    count = site.heads[0] if point == "query" else site.heads[1]
    return HeadwiseQuantize([one(f"{label}{ops.HEAD_SUFFIX}{h}") for h in range(count)], label)


def _backward_specs(actions: list[Action[QuantRule]]) -> dict[str, BackwardSpec]:
    """Site name -> the non-default backward its weight/input rules ask for; two rules that ask
    one site for different ones, or a site that is not a Linear, are refused."""
    found: dict[str, tuple[BackwardSpec, str]] = {}
    for action in actions:
        spec = action.payload.backward_spec()
        if spec is None or action.point == "output":
            continue
        site = action.site
        if site.kind not in ("linear", "conv1d") or site.param:
            raise UserError(f"{action.rule} at {site.name}: backward {spec.mode!r} is available on "
                            f"Linear and Conv1D sites only (this is a {site.kind} site); exclude "
                            "it with ignore")
        outputs = _tensor_shape(site, "output")
        h = spec.dgrad_hadamard
        if h is not None and outputs is not None and outputs[0] % h.block:
            raise UserError(f"{action.rule} at {site.name}: dgrad_hadamard's block of {h.block} does "
                            f"not divide its {outputs[0]} output features; use a block that does, or "
                            "exclude the site with ignore")
        known = found.setdefault(site.name, (spec, action.rule))
        if known[0] != spec:
            raise UserError(f"{site.name}: {known[1]} and {action.rule} ask its GEMMs for different "
                            "backward passes; give both rules the same backward fields")
    return {name: spec for name, (spec, _) in found.items()}


@register_pass
class FakeQuantPass(Pass[list[QuantRule], QuantRule]):
    """Inserts `FakeQuantize` on every (site, tensor) the policy's `quantize` rules select."""

    name = tag = "fake_quant"  # the one spelling: other modules read FakeQuantPass.name / .label
    section = "quantize"
    provides = (name,)

    def __init__(self) -> None:
        self._groups: dict[str, list[Site]] = {}  # site name -> its scale group (select)
        self._shared: dict[str, ScaleGroup] = {}  # first member's name -> the group (build)
        self._backward: dict[str, BackwardSpec] = {}  # site name -> its non-default backward

    def select(self, program: Program, spec: list[QuantRule]) -> list[Action[QuantRule]]:
        """The rules' actions; a block or tile longer than the axis it runs along at a site
        (the weight's shape, an activation's feature dim) is refused here, before anything is
        built, by `formats.check_fits`'s UserError naming the site."""
        actions = resolve_quantize(program, spec)
        for action in actions:
            shape = _tensor_shape(action.site, action.point)
            if shape is not None:
                config = action.payload.config().bind(action.site.reduction_axis
                                                      if action.point == "weight" else -1)
                try:
                    check_fits(config, shape)
                except UserError as exc:
                    raise UserError(f"{action.rule} at {action.site.name} ({action.point}): {exc}") from None
        self._groups = {s.name: group for group in share_groups(program, spec, actions) for s in group}
        self._backward = _backward_specs(actions)
        return actions

    def finish(self, program: Program, actions: list[Action[QuantRule]]) -> None:
        """Sites whose rule asks for another backward than the straight-through one run their
        linear op through `BackwardLinear` (core/backward.py), given the operands before the
        fake-quants."""
        for name, spec in self._backward.items():
            gsite = program.site_graph(name)
            before = {}
            for point in ("weight", "input"):
                head = gsite.heads.get(point)
                if head is not None and head.meta.get("qtransform", {}).get("pass") == self.name:
                    before[point] = head.args[0]
            try:
                module = BackwardLinear(spec, f"{name}/backward", transposed=gsite.site.kind == "conv1d")
                gsite.replace_linear(module, before=before, tag="backward")
            except ValueError as exc:
                raise UserError(f"{exc}: a non-default quantize backward needs a Linear or Conv1D site") from None

    def build(self, program: Program, action: Action[QuantRule]) -> nn.Module:
        site, rule = action.site, action.payload
        if site.kind == ATTENTION_KIND:
            return attention_quantizer(site, action.point, rule)
        weight = action.point == "weight"
        config = rule.config().bind(site.reduction_axis if weight else -1)
        label = self.label(site.name, action.point)
        static = None
        if not weight and activation_global_scale(rule) == "static":
            name = observer_name(rule)
            assert name is not None
            kwargs = rule.observer_kwargs
            static = StaticScale(name, config.block, kwargs.averaging_constant if kwargs else 0.01,
                                 routed=site.kind == "experts", tensor=action.point)
        group = self._group(program, site) if weight else None
        return FakeQuantize(config, label, cache=weight,
                            per_expert=site.kind == "experts" and weight, lora=rule.lora,
                            global_scale=None if weight else activation_global_scale(rule),
                            static_scale=static, group=group)

    def _group(self, program: Program, site: Site) -> ScaleGroup | None:
        members = self._groups.get(site.name)
        if members is None:
            return None
        key = members[0].name
        if key not in self._shared:
            self._shared[key] = ScaleGroup(
                [(m.name, program.model.get_submodule(m.module_name), m.param or "weight")
                 for m in members], per_expert=members[0].kind == "experts")
        return self._shared[key]

    def describe(self, action: Action[QuantRule]) -> str:
        text = action.payload.config().describe()
        backward = self._backward.get(action.site.name)
        if backward is not None and action.point != "output":
            text += f", {backward.describe()}"
        if action.point == "weight":
            group = self._groups.get(action.site.name)
            if group is not None:
                others = [s.name for s in group if s.name != action.site.name]
                text += f", global scale shared with {', '.join(others) or 'none'}"
            return text
        source = activation_global_scale(action.payload)
        if source == "static":
            text += f", global_scale=static ({observer_name(action.payload)})"
        elif source == "tensor":
            text += ", global_scale=tensor (depends on the batch)"
        elif source == "token":
            text += ", global_scale=token"
        return text

    def notes(self, actions: list[Action[QuantRule]]) -> list[str]:
        lines = []
        batchwise = [a for a in actions if a.point != "weight"
                     and activation_global_scale(a.payload) == "tensor"]
        if batchwise:
            lines.append(f"Outputs depend on the batch: {len(batchwise)} activation fake-quant(s) "
                         'take their global scale from the whole tensor of each call (global_scale '
                         '"tensor"), so a sequence\'s outputs change with the other sequences in '
                         'its batch; "token" or scale_source "static" avoid it.')
        static = [a for a in actions if a.point != "weight"
                  and activation_global_scale(a.payload) == "static"]
        if static:
            lines.append(f"{len(static)} static global scale(s): calibrated by transform(..., "
                         "calibration=batches) (CLI: --calib FILE), then frozen.")
        groups = {id(g): g for g in self._groups.values()}
        if groups:
            lines.append(f"{len(groups)} scale group(s) share one weight global scale each "
                         "(the largest amax of the group).")
        return lines
