"""What a transformed model asks a checkpoint to hold: its Linears with their weight and input
fake-quants, its LoRA layers, its attention modules' key/value (and query, probs) quantizers,
and what cannot go into any quantized checkpoint.

The checkpoint is the model as deployed: noise (AQN, hardware error, activation noise) is left
out, as `qtransform.evaluation` switches it off; taps only observe. Everything else that changes
numbers and has no field in a checkpoint format is refused here, before a file is written, one
line per reason (`Refusals`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from qtransform.core.attention import is_attention
from qtransform.core.lora import is_lora_layer, lora_mode
from qtransform.core.noise import NoiseModule
from qtransform.core.scales import FUSED_NAMES
from qtransform.core.sites import ADAPTER_KEYS, hf_name
from qtransform.core.tracing import module_graph
from qtransform.errors import UserError
from qtransform.passes import FakeQuantize, RotatePass
from qtransform.passes.fake_quant import HeadwiseQuantize
from qtransform.passes.instrument import InstrumentPass


@dataclass
class LinearExport:
    """One nn.Linear of the model under its Hugging Face name, as the checkpoint stores it."""

    name: str
    module: nn.Linear
    weight: FakeQuantize | None = None  # None: kept in high precision
    input: FakeQuantize | None = None
    lora: nn.Module | None = None  # the PEFT LoRA layer around it
    rotation: nn.Module | None = None  # the rotate pass's module on its weight (W·R is stored), or
    # on its input where the weight holds W·R already (`stored_weight`, an opened rotated checkpoint)

    @property
    def quantized(self) -> bool:
        return self.weight is not None or self.input is not None


@dataclass
class AttentionExport:
    """One attention module under its Hugging Face name, with the quantizer of each of its
    points ("key", "value", "query", "probs"): a `FakeQuantize`, or a `HeadwiseQuantize` (one
    scale per head)."""

    name: str
    module: nn.Module
    points: dict[str, nn.Module] = field(default_factory=dict)
    rotations: dict[str, nn.Module] = field(default_factory=dict)  # "query"/"key" -> its Rotate


@dataclass
class Collected:
    """The model's Linears (every one, by HF name, in module order), its attention modules,
    what was left out, and the refusals common to every format."""

    linears: dict[str, LinearExport] = field(default_factory=dict)
    attention: dict[str, AttentionExport] = field(default_factory=dict)
    embeddings: list[str] = field(default_factory=list)  # nn.Embedding modules, kept as they are
    left_out: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


class Refused(UserError):
    """The model cannot be written in the asked format: one line per reason."""


def raise_refusals(refusals: list[str], fmt: str) -> None:
    """One UserError listing every reason, or nothing."""
    if not refusals:
        return
    unique = list(dict.fromkeys(refusals))
    if len(unique) == 1:
        raise Refused(f"cannot export as {fmt}: {unique[0]}")
    more = "; ".join(unique[1:4]) + (f"; and {len(unique) - 4} more" if len(unique) > 4 else "")
    raise Refused(f"cannot export as {fmt}: {unique[0]} (also: {more})")


def _is_adapter(name: str) -> bool:
    return any(part in ADAPTER_KEYS for part in name.split("."))


def collect(model: nn.Module, *, requantize_lora: bool = False) -> Collected:
    """Walk `model` (a qtransform-transformed model, PEFT-wrapped or not)."""
    out = Collected()
    for name, module in model.named_modules():
        if _is_adapter(name):
            continue
        key = hf_name(name)
        if is_lora_layer(module):
            out.linears.setdefault(key, LinearExport(key, module.base_layer)).lora = module
            continue
        if isinstance(module, nn.Embedding):
            out.embeddings.append(key)
        if isinstance(module, nn.Linear):
            out.linears.setdefault(key, LinearExport(key, module)).module = module
        if is_attention(module):
            out.attention[key] = AttentionExport(key, module)
        _insertions(out, key, module)
    for entry in out.linears.values():
        _check_lora(out, entry, requantize_lora)
    _check_fused(out)
    return out


def _insertions(out: Collected, key: str, module: nn.Module) -> None:
    state = module_graph(module)
    if state is None:
        return
    for ins in state.insertions:
        child = module._modules.get(ins.module_path.rsplit(".", 1)[-1])
        where = f"{key} ({ins.point})"
        if isinstance(child, NoiseModule):
            out.left_out.append(f"{ins.pass_name} at {where}")
        elif ins.pass_name == InstrumentPass.name:
            continue  # a tap observes, it changes nothing
        elif ins.pass_name == RotatePass.name:
            _rotation(out, key, module, child, ins.point, where)
        elif key in out.attention and isinstance(child, (FakeQuantize, HeadwiseQuantize)):
            _attention_quantizer(out, key, child, ins.point, where)
        elif isinstance(child, FakeQuantize):
            if not child.enabled:
                out.left_out.append(f"switched-off fake-quant at {where}")
            elif not isinstance(module, nn.Linear):
                out.refusals.append(f"{where} is quantized but is not an nn.Linear "
                                    f"({type(module).__name__}); checkpoints store quantized Linear "
                                    "weights only: leave it out of the quantize rules")
            elif ins.point == "output":
                out.refusals.append(f"{where}: output quantization has no field in a checkpoint "
                                    "(engines quantize weights and inputs); drop the rule's 'output' tensor")
            elif child.config.stochastic:
                out.refusals.append(f"{where}: stochastic rounding draws new values every forward, "
                                    "a checkpoint holds one rounding; use rounding 'rne'")
            else:
                setattr(out.linears[key], ins.point, child)
        else:
            out.refusals.append(f"{where}: the {ins.pass_name!r} pass changes the values and no "
                                "checkpoint field holds it; transform without it")


def _attention_quantizer(out: Collected, key: str, child: nn.Module, point: str, where: str) -> None:
    """A quantizer on an attention point: the formats' KV-cache schemes decide what they hold."""
    quantizers = list(child.heads) if isinstance(child, HeadwiseQuantize) else [child]
    if not all(q.enabled for q in quantizers):
        out.left_out.append(f"switched-off fake-quant at {where}")
    elif any(q.config.stochastic for q in quantizers):
        out.refusals.append(f"{where}: stochastic rounding draws new values every forward, a "
                            "checkpoint holds one rounding; use rounding 'rne'")
    else:
        out.attention[key].points[point] = child


def _rotation(out: Collected, key: str, module: nn.Module, child: nn.Module, point: str, where: str) -> None:
    """A rotate insertion: the weight's rotation is stored fused (W·R), the input's is the online
    transform an engine runs; both only on an nn.Linear; an attention's query and key rotations
    are online transforms of the attention module (compressed-tensors' q_attn, k_cache).
    An input rotation whose weight is stored rotated stands for both (its weight is W·R as is)."""
    if not getattr(child, "enabled", True):
        out.left_out.append(f"switched-off rotation at {where}")
    elif key in out.attention and point in ("query", "key"):
        out.attention[key].rotations[point] = child
    elif not isinstance(module, nn.Linear):
        out.refusals.append(f"{key} is rotated but is not an nn.Linear ({type(module).__name__}); "
                            "checkpoint transforms apply to nn.Linear inputs only: leave it out of the "
                            "rotate rules (ignore)")
    elif point == "weight" or getattr(child, "stored_weight", False):
        out.linears[key].rotation = child


def _check_lora(out: Collected, entry: LinearExport, requantize_lora: bool) -> None:
    if entry.lora is None or entry.weight is None:
        return
    if lora_mode(entry.module) == "beside" and not requantize_lora:
        out.refusals.append(
            f"{entry.name}: its LoRA adapter runs beside the quantized weight (lora 'beside': "
            "quant(W) + s B A), which no quantized checkpoint holds; train with lora 'merged' "
            "(quant(W + s B A)), or pass requantize_lora=True to store quant(W + s B A)")


def fused_sets(linears: dict[str, LinearExport]) -> list[tuple[str, list[LinearExport]]]:
    """(parent, members) of the siblings an engine fuses into one Linear (q/k/v, gate/up)."""
    by_parent: dict[str, dict[str, LinearExport]] = {}
    for entry in linears.values():
        parent, _, leaf = entry.name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = entry
    return [(parent, [children[n] for n in names]) for parent, children in by_parent.items()
            for names in FUSED_NAMES if all(n in children for n in names)]


def _check_fused(out: Collected) -> None:
    """Siblings an engine fuses into one Linear must be quantized alike."""
    for parent, members in fused_sets(out.linears):
        names = [m.name.rpartition(".")[2] for m in members]
        quantized = [n for n, m in zip(names, members, strict=True) if m.quantized]
        if quantized and len(quantized) < len(members):
            rest = [n for n in names if n not in quantized]
            out.refusals.append(
                f"{parent}: {'/'.join(names)} run as one fused Linear in the engines, but "
                f"{', '.join(quantized)} {'is' if len(quantized) == 1 else 'are'} quantized and "
                f"{', '.join(rest)} not: quantize all of them or none")
            continue
        configs = {(m.weight.config if m.weight else None, m.input.config if m.input else None)
                   for m in members}
        if len(configs) > 1:
            out.refusals.append(f"{parent}: {'/'.join(names)} run as one fused Linear in the "
                                "engines but are quantized differently: give them one rule")
