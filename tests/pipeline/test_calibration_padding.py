"""Calibration honours the attention mask: observers see real tokens only, as llm-compressor
calibrates on unpadded samples, so one padded batch calibrates what its sequences one by one do.

The pad token's embedding is made an outlier ([0, 0, 0, 1000, 0, ...]: its normalized hidden
state is sqrt(hidden) times the norm's weight, ~2.4x the real tokens' largest input), so a
padded position seen by an observer shows in its scale (8.0 where the real tokens' amax is 3.3;
logits 0.028 (FP8) and 0.091 (NVFP4) away, before observers honoured the mask).

Padded and alone, the model runs GEMMs of other shapes (a batch of 3 against one sequence), and
whether a row's bits depend on the other rows is the BLAS library's choice: MKL on the machine
that wrote these tests gives equal bits once a product has 12 rows or more (hence lengths 12, 16
and 20), another CPU or library may not. So `assert_same_calibration` asks for the same bits
where the full-precision activations are the same bits, and otherwise for the scales within
float32 rounding of the GEMMs (far below what one observed pad does) and logits within what such
a rounding of a scale can move.
"""

from __future__ import annotations

import pytest
import torch

import qtransform
from qtransform.calibration import unpadded_positions
from qtransform.core.observers import static_scales
from qtransform.errors import UserError
from qtransform.models import build_tiny

PAD = 0
LENGTHS = (12, 16, 20)
RULE = {"targets": ["Linear"], "ignore": ["lm_head"], "format": "nvfp4",
        "tensors": ["weight", "input"], "scale_source": "static"}


def outlier_pad(arch: str = "qwen2") -> torch.nn.Module:
    model = build_tiny(arch)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[PAD].zero_()
        emb[PAD, 3] = 1000.0
    return model


def sequences(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g) for n in LENGTHS]


def padded(seqs: list[torch.Tensor], side: str, pad: int = PAD) -> dict[str, torch.Tensor]:
    """One batch of `seqs`, padded on `side` with token `pad`, and its attention mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[i, cols], mask[i, cols] = s, 1
    return {"input_ids": ids, "attention_mask": mask}


def scales(model: torch.nn.Module) -> dict[str, float]:
    return {name: s.amax.item() for name, s in static_scales(model).items()}


def assert_same_calibration(got: dict[str, float], want: dict[str, float]) -> None:
    """Bit for bit where the library's GEMMs give rows the same bits at any batch size; within
    their float32 rounding (1e-5 relative) elsewhere."""
    assert got.keys() == want.keys()
    if got != want:
        assert all(abs(got[k] - want[k]) <= 1e-5 * abs(want[k]) for k in want), (got, want)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("preset", ["llm-compressor/FP8", "llm-compressor/NVFP4"])
def test_a_padded_batch_calibrates_what_its_sequences_one_by_one_do(preset, side):
    seqs = sequences()
    policy = {"preset": preset}
    alone = qtransform.transform(outlier_pad(), policy, calibration=[{"input_ids": s[None]} for s in seqs])
    batch = qtransform.transform(outlier_pad(), policy, calibration=[padded(seqs, side)])
    want, got = scales(alone), scales(batch)
    assert len(want) == 14  # every site (q/k/v, o, gate/up, down)
    assert_same_calibration(got, want)
    with torch.no_grad():
        for s in seqs:
            ours, theirs = batch(input_ids=s[None]).logits, alone(input_ids=s[None]).logits
            if got == want:  # the same scales: the same model, the same bits
                assert torch.equal(ours, theirs)
            else:  # a scale a rounding apart may move an element one grid step
                assert (ours - theirs).abs().max() < 5e-3


@pytest.mark.parametrize("observer", ["static_minmax", "minmax", "memoryless_minmax"])
def test_no_observer_sees_what_padding_holds(observer):
    """Every observer kind: a padded batch's scales do not depend on its pad token."""
    policy = {"version": 1, "quantize": [{**RULE, "observer": observer}]}
    batch = padded(sequences(), "right")
    other = {**batch, "input_ids": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7)}
    model = outlier_pad()
    got = scales(qtransform.transform(model, policy, calibration=[batch, batch]))
    assert got == scales(qtransform.transform(model, policy, calibration=[other, other]))


def test_experts_rows_are_mapped_to_their_tokens():
    """A fused experts module's inputs are token rows repeated top_k times and grouped by expert:
    each row is kept or dropped by the token it came from."""
    seqs = sequences()
    policy = {"preset": "llm-compressor/FP8"}
    alone = scales(qtransform.transform(outlier_pad("qwen3_moe"), policy,
                                        calibration=[{"input_ids": s[None]} for s in seqs]))
    got = scales(qtransform.transform(outlier_pad("qwen3_moe"), policy, calibration=[padded(seqs, "left")]))
    assert sum("experts" in name for name in got) == 4
    assert_same_calibration(got, alone)


def test_shared_expert_inputs_are_flattened_tokens():
    """Qwen2-MoE's shared expert runs on [batch * tokens, hidden] rows: mapped by their row."""
    policy = {"preset": "llm-compressor/FP8"}
    batch = padded(sequences(), "right")
    other = {**batch, "input_ids": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 7)}
    model = outlier_pad("qwen2_moe")
    got = scales(qtransform.transform(model, policy, calibration=[batch]))
    assert any("shared_expert" in name for name in got)
    assert got == scales(qtransform.transform(model, policy, calibration=[other]))


def test_an_all_ones_mask_and_no_mask_calibrate_alike():
    batch = padded(sequences()[:1], "right")
    model = build_tiny("qwen2")
    policy = {"version": 1, "quantize": [RULE]}
    with_mask = scales(qtransform.transform(model, policy, calibration=[batch]))
    assert with_mask == scales(qtransform.transform(model, policy, calibration=[batch["input_ids"]]))


@pytest.mark.parametrize(("mask", "message"), [
    (torch.ones(3, 19, dtype=torch.long), r"calibration batch 1: attention_mask of shape \(3, 19\) "
                                          r"does not match its tokens \(3, 20\)"),
    (torch.ones(3, 1, 1, 20), r"attention_mask of shape \(3, 1, 1, 20\) does not match"),
    (torch.full((3, 20), 2), "attention_mask holds values other than 0 and 1"),
])
def test_a_wrong_mask_is_refused_in_one_line(mask, message):
    batch = padded(sequences(), "right")
    with pytest.raises(UserError, match=message) as info:
        qtransform.transform(build_tiny("qwen2"), {"version": 1, "quantize": [RULE]},
                             calibration=[batch, {**batch, "attention_mask": mask}])
    assert "\n" not in str(info.value)


def test_a_tensor_without_token_positions_is_refused_under_padding():
    """BERT's pooler sees one row per sequence: its positions are not the mask's."""
    model = build_tiny("bert")
    policy = {"version": 1, "quantize": [{**RULE, "targets": ["pooler.dense"], "ignore": []}]}
    batch = padded(sequences(), "right")
    with pytest.raises(UserError, match=r"pooler\.dense/input_fake_quant: a tensor of shape \(3, 64\) has no "
                                        r"token positions of the attention_mask \[3, 20\]"):
        qtransform.transform(model, policy, calibration=[batch])
    unpadded = {k: v[1:2, :16] for k, v in batch.items()}  # one sequence: all ones
    assert len(scales(qtransform.transform(model, policy, calibration=[unpadded]))) == 1


def test_left_padding_gets_the_positions_of_the_sequences_alone():
    model = build_tiny("qwen2")
    batch = padded([torch.arange(1, 3), torch.arange(1, 5)], "left")
    assert unpadded_positions(model, batch, batch["attention_mask"])["position_ids"].tolist() == [
        [1, 1, 0, 1], [0, 1, 2, 3]]
    right = padded([torch.arange(1, 3), torch.arange(1, 5)], "right")
    assert "position_ids" not in unpadded_positions(model, right, right["attention_mask"])
    given = {**batch, "position_ids": torch.zeros(2, 4, dtype=torch.long)}
    assert unpadded_positions(model, given, batch["attention_mask"]) is given
