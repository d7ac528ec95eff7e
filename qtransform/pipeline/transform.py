"""`transform()` and `plan()`: a policy applied to a model, or what applying it would do."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from types import ModuleType

import torch
from torch import Tensor, nn

from qtransform.calibration import CalibrationBatches, calibrate
from qtransform.checkpoints.reader import FORMATS
from qtransform.core.capture import ExampleInputs, capture
from qtransform.core.lora import watch_lora
from qtransform.core.observers import StaticScale, StoredScale, static_scales
from qtransform.core.phase import mark_rollout_generate
from qtransform.core.plan import Plan, PlanRow
from qtransform.core.program import Program, insertion_log
from qtransform.core.sharding import check_unwrapped
from qtransform.core.shortcut import install_shortcuts
from qtransform.errors import UserError
from qtransform.models import loaded_checkpoint
from qtransform.pipeline.base import Pass, registered_passes
from qtransform.pipeline.manager import PassManager
from qtransform.schemas import Policy, PolicyLike, load_policy

ScaleValue = Tensor | StoredScale  # a static scale's value: an amax, or a checkpoint's stored scale


def transform(
    model: nn.Module,
    policy: PolicyLike,
    example_inputs: ExampleInputs | None = None,
    *,
    inplace: bool = False,
    mode: str = "module",
    passes: Iterable[Pass] | None = None,
    calibration: CalibrationBatches | None = None,
) -> nn.Module:
    """Apply a policy to a model and return the transformed model.

    Args:
        model: any `nn.Module` (a transformers model, a PEFT model, a plain torch model).
        policy: a `Policy`, a dict, JSON text or a path to a JSON file.
        example_inputs: inputs for a whole-model capture (`torch.export`); needed for
            `mode="graph"` and for attention-matmul sites.
        inplace: transform `model` itself instead of a deep copy (saves memory on large models);
            if the transform raises, the model is put back exactly as it was. By default the
            caller's model is left untouched.
        mode: `"module"` keeps the user's model and class (each site module runs its own graph);
            `"graph"` returns the whole-model graph module.
        passes: the passes to run; default: every registered pass.
        calibration: batches (model-input dicts, or input_ids tensors) that calibrate the
            policy's static scales (`scale_source: "static"`), which are then frozen; required
            when the policy has any, ignored otherwise.

    Example::

        model = qtransform.transform(model, {"version": 1, "quantize": [
            {"targets": ["Linear"], "ignore": ["lm_head"], "format": "mxfp4"}]})
    """
    return transform_program(model, policy, example_inputs, inplace=inplace, mode=mode, passes=passes,
                             calibration=calibration).module()


def transform_program(
    model: nn.Module,
    policy: PolicyLike,
    example_inputs: ExampleInputs | None = None,
    *,
    inplace: bool = False,
    mode: str = "module",
    passes: Iterable[Pass] | None = None,
    calibration: CalibrationBatches | None = None,
    scales: Mapping[str, ScaleValue] | None = None,
) -> Program:
    """`transform`, returning the `Program` (site table, graphs, insertion log, plan rows);
    `.module()` of it is what `transform` returns. Arguments as for `transform`; `scales`
    (static scale path -> amax or `StoredScale`, as `save_transformed` writes them) sets the
    static scales instead of calibrating them."""
    check_unwrapped(model)
    policy = load_policy(policy)
    static = static_rules(policy)
    if static and mode == "graph":
        raise UserError(f"the policy's {', '.join(static)} calibrate static scales, which need "
                        'mode="module" (the model keeps its class and runs the calibration)')
    kv = None
    if static and calibration is None and scales is None:
        scales, kv = checkpoint_scales(model), checkpoint_kv_scales(model)
        scales = {} if scales is None and kv is not None else scales
    if static and calibration is None and scales is None:
        raise UserError(f"the policy's {', '.join(static)} calibrate static scales (scale_source "
                        '"static"): pass calibration=batches to qtransform.transform (CLI: '
                        "--calib FILE)")
    manager = PassManager(list(passes) if passes is not None else registered_passes())
    work = model if inplace else copy.deepcopy(model)
    program = capture(work, example_inputs, mode=mode)
    try:
        manager.run(program, policy)
        check_stored_rotations(model, program.module())
        if scales is not None:
            load_scales(work, {**by_path(work, scales), **kv_paths(program, kv)})
        elif calibration is not None:
            calibrate(work, calibration, attention=policy.calibration.attention
                      if policy.calibration is not None else "model")
            program.plan_rows = calibrated_rows(program)
    except BaseException:
        program.restore()  # inplace: the caller's model exactly as it was
        raise
    if mode == "module":
        mark_rollout_generate(work)
        watch_lora(work)
    install_shortcuts(program.module())
    return program


def check_stored_rotations(model: nn.Module, transformed: nn.Module) -> None:
    """A checkpoint whose weights hold W·R (online rotations in its transform_config) computes
    its model only with those inputs rotated online by the same Hadamard: a policy that leaves
    one out (or rotates the stored weight again) is an error, not a silently other model."""
    checkpoint = loaded_checkpoint(model)
    if checkpoint is None or not checkpoint.rotated:
        return
    have = {}
    for ins in insertion_log(transformed):
        child = transformed.get_submodule(ins.module_path)
        if ins.pass_name == "rotate" and ins.point == "input":
            have[ins.site] = (child.kind, child.block, child.stored_weight)
    wrong = []
    for g in checkpoint.rotations:
        if g.point != "input":  # a query and key rotation has no stored weight
            continue
        for name in checkpoint.rotated[g.name]:
            block = g.block or transformed.get_submodule(name).in_features
            if have.get(name) != ("hadamard", block, True):
                wrong.append((name, g, block))
    if wrong:
        name, g, block = wrong[0]
        more = f" (and {len(wrong) - 1} more modules)" if len(wrong) > 1 else ""
        raise UserError(f"{name}: the checkpoint stores its weight rotated (W·R, transform_config "
                        f"group {g.name!r}), so its input needs the {block}-wide Hadamard rotation "
                        f"online and its weight none; the policy does otherwise{more}: add the "
                        "checkpoint's rotate rules (checkpoint_policy(model)['rotate'], weight "
                        "'stored'), or give no policy")


def checkpoint_scales(model: nn.Module) -> dict[str, StoredScale] | None:
    """The static input scales stored in the quantized checkpoint `model` was opened from, by
    module name (`by_path` places them on the policy's static scales), or None. They stay the
    stored numbers (NVFP4's global scale, FP8's input scale): the fake-quants use them as the
    checkpoint's library does, never through an amax reconstructed from them."""
    checkpoint = loaded_checkpoint(model)
    if checkpoint is None or not checkpoint.input_scales:
        return None
    return {name: StoredScale(scale) for name, scale in checkpoint.input_scales.items()}


def checkpoint_kv_scales(model: nn.Module) -> KVScales | None:
    """The KV-cache scales stored in the quantized checkpoint `model` was opened from: by
    (attention module, "key" or "value"), one value per head (or one), with the producer's
    fields to read them by; None without."""
    checkpoint = loaded_checkpoint(model)
    if checkpoint is None or checkpoint.kv is None:
        return None
    return KVScales(FORMATS[checkpoint.producer], dict(checkpoint.kv.fields),
                    {key: [v.reshape(()) for v in values] for key, values in checkpoint.kv_scales.items()})


class KVScales:
    """A checkpoint's stored KV scales and how its producer's format reads them."""

    def __init__(self, fmt: ModuleType, fields: dict, values: dict[tuple[str, str], list[Tensor]]):
        self.fmt, self.fields, self.values = fmt, fields, values

    def value(self, quantizer: nn.Module, stored: Tensor) -> ScaleValue:
        """`stored` as the static scale of `quantizer`: vLLM's NVFP4 cache writer takes the
        checkpoint's k_scale itself; every other rule the producer's reading (`kv_value`)."""
        config = getattr(quantizer, "config", None)
        if config is not None and config.name == "nvfp4" and config.nvfp4_variant in ("vllm-kv", "flashinfer-kv"):
            return StoredScale(stored)
        return self.fmt.kv_value(self.fields, stored)


def kv_paths(program: Program, kv: KVScales | None) -> dict[str, ScaleValue]:
    """KV scales keyed by the static-scale paths of the quantizers the transform inserted on
    each attention's key and value (one per head, in order; a rotation before them has none)."""
    if kv is None:
        return {}
    root = program.module()
    own = list(static_scales(root))
    out: dict[str, ScaleValue] = {}
    for (site, point), values in kv.values.items():
        inserted = [i.module_path for i in program.log if i.site == site and i.point == point]
        paths = [p for path in inserted for p in own if p.startswith(path + ".")]
        if len(paths) == 1 < len(values) and _engine_cpu_writer(root.get_submodule(paths[0].rpartition(".")[0])):
            values = [torch.stack(values).amax()]  # vLLM's CPU backend: one scale, the heads' max
        if len(paths) != len(values):
            raise UserError(f"{site} ({point}): the checkpoint stores {len(values)} KV scale(s), the "
                            f"policy's quantizer there has {len(paths)}; open it with its own "
                            "policy (checkpoint_policy)")
        out.update({p: kv.value(root.get_submodule(p.rpartition(".")[0]), v)
                    for p, v in zip(paths, values, strict=True)})
    return out


def _engine_cpu_writer(quantizer: nn.Module) -> bool:
    """Whether `quantizer` is vLLM CPU's FP8 cache writer, which reads a per-head checkpoint's
    scales as their max (`CompressedTensorsKVCacheMethod`'s `_to_scalar`, measured)."""
    config = getattr(quantizer, "config", None)
    return config is not None and getattr(config, "fp8_variant", None) == "vllm-cpu"


def by_path(model: nn.Module, scales: Mapping[str, ScaleValue]) -> Mapping[str, ScaleValue]:
    """Scales keyed by static-scale path as they are, or keyed by the module that owns each
    static scale (a checkpoint's input scales) moved onto that scale's path."""
    own = static_scales(model)
    if set(scales) & set(own) or not own:
        return scales
    moved = {}
    for path in own:
        owner = max((name for name in scales if path.startswith(name + ".")), key=len, default=None)
        if owner is not None:
            moved[path] = scales[owner]
    return moved


def static_rules(policy: Policy) -> list[str]:
    """Labels of the quantize rules with static (calibrated) scales."""
    return [f"quantize[{i}]" + (f" {r.name!r}" if r.name else "") for i, r in enumerate(policy.quantize)
            if r.scale_source == "static"]


def load_scales(model: nn.Module, scales: Mapping[str, ScaleValue]) -> None:
    """Set every static scale from saved values; one missing or extra is an error naming it."""
    own = static_scales(model)
    missing = sorted(set(own) - set(scales))
    extra = sorted(set(scales) - set(own))
    if missing or extra:
        raise UserError("the saved static scales do not fit the policy's: "
                        + (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}")
                        + f" ({len(missing)} missing, {len(extra)} unexpected)")
    for name, scale in own.items():
        scale.load(scales[name])


def calibrated_rows(program: Program) -> list[PlanRow]:
    """The plan rows with each static scale's calibrated amax."""
    values = {}
    for ins in program.insertions():
        found = [m for m in program.model.get_submodule(ins.module_path).modules()
                 if isinstance(m, StaticScale) and m.frozen]
        if found:
            values[(ins.site, ins.pass_name, ins.point)] = found[0].amax.item()
    return [PlanRow(r.site, r.pass_name, r.point, r.rule, r.detail + f", amax={v:.6g}")
            if (v := values.get((r.site, r.pass_name, r.point))) is not None else r
            for r in program.plan_rows]


def plan(model: nn.Module, policy: PolicyLike, example_inputs: ExampleInputs | None = None,
         passes: Iterable[Pass] | None = None) -> Plan:
    """What `transform` would do, without doing it: every site with its selecting rules."""
    policy = load_policy(policy)
    manager = PassManager(list(passes) if passes is not None else registered_passes())
    program = capture(model, example_inputs)
    selected = manager.select(program, policy)
    rows = [PlanRow(a.site.name, p.name, a.point, a.rule, p.describe(a)) for p, a in selected]
    notes = [line for p in manager.order for line in p.notes([a for q, a in selected if q is p])]
    notes += program.preset_misses
    return Plan(list(program.sites.values()), rows, notes, dict(program.skipped_routers))
