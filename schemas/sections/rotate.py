"""The `rotate` section: orthogonal rotations of a product's reduction axis before quantization.

A rotation R (orthogonal, b×b, applied per block of b consecutive elements) maps both operands
of a product alike, so the full-precision product is unchanged while an outlier channel is
spread over its block before a fake quantization sees it (QuaRot, SpinQuant, FP-Quant's Hadamard
groups, compressed-tensors' transforms). Point `input`: a Linear's input and weight, x ↦ x·R and
W ↦ W·R ((x·R)(W·R)ᵀ = x·Wᵀ). Point `query_key`: an attention's query and key after RoPE along
head_dim ((q·R)(k·R)ᵀ = q·kᵀ; SpinQuant's R3), the key as the KV cache holds it. Rules run
before any `quantize` rule at the same points; a later rule overrides an earlier one for the
same site. docs/rotations.md has the kinds, the points reached and what an engine must apply online.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, StrictStr, model_validator

from ..base import NonNegInt, PosInt, Selected
from ..errors import Issue, problems_error
from ..words import describe_selector
from . import Section, register_section

KINDS = ("hadamard", "random_hadamard", "matrix")
MATRIX_SUFFIXES = (".safetensors", ".pt", ".pth")
LORA_MODES = ("unrotated", "rotated")
WEIGHT_MODES = ("rotate", "stored")
POINTS = ("input", "query_key")
ATTENTION_POINT = "query_key"  # an attention's query and key, rotated together along head_dim


class RotateRule(Selected):
    """Rotate the reduction axis of the selected sites: a Linear's input and weight alike, or an
    attention's query and key alike (point query_key)."""

    name: Annotated[StrictStr, Field(min_length=1)] | None = Field(
        None, description="the rule's name in plans, logs and reports (unique)")
    kind: Literal[KINDS] = Field(  # type: ignore[valid-type]
        "hadamard", description=(
            "hadamard: the Sylvester Walsh-Hadamard matrix H_b/sqrt(b); random_hadamard: "
            "diag(signs)·H_b with signs from the Philox stream of `seed`; matrix: an orthogonal "
            "b×b matrix read from the file `matrix` (a learned SpinQuant rotation)"))
    block_size: PosInt | None = Field(
        None, description=("features per rotated block: a power of two that divides the axis "
                           "(hadamard kinds; the axis is head_dim at point query_key); null = "
                           "the whole axis (a power of two), or the matrix's size for kind matrix"))
    seed: NonNegInt = Field(0, description="random_hadamard: the seed of the sign stream")
    matrix: StrictStr | None = Field(
        None, description=("kind matrix: path of a .safetensors (one tensor) or .pt file holding "
                           "a square orthogonal matrix, read when the policy is applied"))
    point: Literal[POINTS] = Field(  # type: ignore[valid-type]
        "input", description=("where the rotation acts: input = the reduction axis of a "
                              "Linear (x ↦ x·R and W ↦ W·R, output unchanged); query_key = an "
                              "attention's query and key after RoPE, together, along head_dim "
                              "(q ↦ q·R, k ↦ k·R: q·kᵀ unchanged, a KV-cache quantizer sees k·R; "
                              'SpinQuant\'s R3; targets default to ["Attention"])'))
    lora: Literal[LORA_MODES] = Field(  # type: ignore[valid-type]
        "unrotated", description=("what a PEFT LoRA adapter on a rotated site sees: unrotated = "
                                  "the input x as PEFT passes it (its A acts on x); rotated = x·R "
                                  "(its A acts in the rotated basis, as a merged weight would)"))
    weight: Literal[WEIGHT_MODES] = Field(  # type: ignore[valid-type]
        "rotate", description=("rotate = the weight becomes W·R (the pass rotates it); stored = the "
                               "weight already holds W·R (a checkpoint with the rotation fused, "
                               "compressed-tensors' weight_input transform): only the input is "
                               "rotated, the weight is used as it is"))

    @model_validator(mode="before")
    @classmethod
    def _attention_spelling(cls, data: Any) -> Any:
        """A query_key rule targets every attention module unless it says otherwise; the
        spellings of the quantize section (`tensors`, a lone query or key) get their fix."""
        if not isinstance(data, dict):
            return data
        if "tensors" in data:
            tensors = data["tensors"]
            hint = (' (write "point": "query_key")' if isinstance(tensors, list) and {"query", "key"} & set(tensors)
                    else ' (remove it: the default point "input" rotates a Linear\'s input and weight)')
            raise problems_error([Issue(("tensors",), "a rotate rule names its point with `point`, "
                                        "not `tensors`", tensors, hint=hint)])
        if data.get("point") in ("query", "key"):
            raise problems_error([Issue(("point",), "the query and the key are rotated together (R on "
                                        "one alone changes q·kᵀ)", data["point"],
                                        hint=' (write "point": "query_key")')])
        if data.get("point") == ATTENTION_POINT and "targets" not in data:
            return {**data, "targets": ["Attention"]}
        return data

    @model_validator(mode="after")
    def _kind_fields(self) -> RotateRule:
        issues = []
        if self.point == ATTENTION_POINT and self.weight != "rotate":
            issues.append(Issue(("weight",), "an attention's query and key have no weight; a stored "
                                "rotation is a Linear's", self.weight, hint=" (remove it)"))
        if self.point == ATTENTION_POINT and self.lora != "unrotated":
            issues.append(Issue(("lora",), "LoRA adapters sit on Linears, not on an attention's query "
                                "and key", self.lora, hint=" (remove it)"))
        if self.kind == "matrix" and self.matrix is None:
            issues.append(Issue(("matrix",), "kind 'matrix' needs the path of its matrix file",
                                hint=" (set matrix to a .safetensors or .pt file)"))
        if self.kind != "matrix" and self.matrix is not None:
            issues.append(Issue(("matrix",), f"a matrix file is read only by kind 'matrix', not {self.kind!r}",
                                self.matrix, hint=' (remove it, or set "kind": "matrix")'))
        if self.matrix is not None and not self.matrix.endswith(MATRIX_SUFFIXES):
            issues.append(Issue(("matrix",), "a rotation matrix file must be .safetensors, .pt or .pth",
                                self.matrix))
        if self.kind != "random_hadamard" and self.seed:
            issues.append(Issue(("seed",), f"only kind 'random_hadamard' draws signs; {self.kind!r} "
                                "has no seed", self.seed))
        b = self.block_size
        if b is not None and self.kind != "matrix" and b & (b - 1):
            issues.append(Issue(("block_size",), "a Hadamard block size must be a power of two", b,
                                hint=f" (e.g. {1 << (b.bit_length() - 1)} or {1 << b.bit_length()})"))
        if issues:
            raise problems_error(issues)
        return self


def _names_unique(rules: list[RotateRule]) -> list[RotateRule]:
    seen: set[str] = set()
    issues = []
    for i, rule in enumerate(rules):
        if rule.name is not None and rule.name in seen:
            issues.append(Issue((i, "name"), "rule names must be unique", rule.name))
        seen.add(rule.name or "")
    if issues:
        raise problems_error(issues)
    return rules


def rule_label(index: int, rule: RotateRule) -> str:
    """How plans and errors name a rule: `rotate[0] 'h32'`."""
    return f"rotate[{index}]" + (f" {rule.name!r}" if rule.name else "")


def kind_words(rule: RotateRule) -> str:
    """'a 32-wide Hadamard rotation', 'a random Hadamard rotation (seed 3) over the whole axis'."""
    width = f"{rule.block_size}-wide " if rule.block_size else ""
    what = {"hadamard": "Hadamard rotation", "random_hadamard": "random Hadamard rotation",
            "matrix": "learned rotation"}[rule.kind]
    tail = "" if rule.block_size else (" over the whole axis" if rule.kind != "matrix" else " of the matrix's size")
    extra = f" (seed {rule.seed})" if rule.kind == "random_hadamard" else (
        f" ({rule.matrix})" if rule.kind == "matrix" else "")
    return f"a {width}{what}{extra}{tail}"


def describe(rules: list[RotateRule]) -> list[str]:
    lines = []
    for i, rule in enumerate(rules):
        adapters = (" LoRA adapters see the rotated input." if rule.lora == "rotated" else "")
        if rule.point == ATTENTION_POINT:
            lines.append(f"{rule_label(i, rule).capitalize()}: the queries and keys of "
                         f"{describe_selector(rule).rstrip(',')} get {kind_words(rule)} along "
                         "head_dim, after RoPE, before any fake quantization (q·kᵀ is unchanged; "
                         "a KV-cache quantizer sees the rotated keys).")
            continue
        if rule.weight == "stored":
            what, tail = "the inputs", (". Their weights already hold W·R (stored rotated) and are "
                                        "used as they are.")
        else:
            what, tail = "the inputs and weights", " (the full-precision output is unchanged)."
        lines.append(f"{rule_label(i, rule).capitalize()}: {what} of "
                     f"{describe_selector(rule).rstrip(',')} get {kind_words(rule)} along their "
                     f"reduction axis, before any fake quantization{tail}{adapters}")
    if len(rules) > 1:
        lines.append("A later rule overrides an earlier one for the same module.")
    return lines


def summary(rules: list[RotateRule]) -> str:
    kinds = ", ".join(f"{r.kind}{'/' + str(r.block_size) if r.block_size else ''}"
                      f"{', weights stored rotated' if r.weight == 'stored' else ''}"
                      f"{' on query and key' if r.point == ATTENTION_POINT else ''}" for r in rules)
    return f"{len(rules)} rotate rule(s) ({kinds})"


register_section(Section(
    "rotate", Annotated[list[RotateRule], AfterValidator(_names_unique)], [], describe, summary,
    order=-1,
    description=("rotations of a Linear's reduction axis (x·R, W·R) or of an attention's query and "
                 "key (q·R, k·R) before quantization, in order"),
    example=[{"targets": ["Linear"], "ignore": ["lm_head"], "kind": "hadamard", "block_size": 32}]))
