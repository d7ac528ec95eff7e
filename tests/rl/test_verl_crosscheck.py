"""qtransform's mismatch metrics, importance weights and rejection masks against verl's own functions,
run from verl's source file (verl itself does not install here: its package imports ray and
tensordict). Set QTRANSFORM_VERL_SOURCE to a checkout's verl/trainer/ppo/rollout_corr_helper.py;
the functions are taken from that file with `ast` and run with verl's masked_sum/masked_mean
semantics (verl/utils/torch_functional.py: a mean divides by count + 1e-8)."""

from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
import torch

from qtransform.rl import importance_weights, mismatch_metrics, rejection_mask
from qtransform.rl.correction import RS_OPTIONS

SOURCE = os.environ.get("QTRANSFORM_VERL_SOURCE")
pytestmark = pytest.mark.skipif(not SOURCE, reason="set QTRANSFORM_VERL_SOURCE to verl's rollout_corr_helper.py")
FUNCTIONS = {"compute_offpolicy_metrics", "compute_rollout_correction_weights", "compute_is_metrics",
             "compute_rollout_rejection_mask", "compute_rs_metrics", "_parse_rollout_rs_thresholds"}
CONSTANTS = {"SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "SAFETY_BOUND"}


class VerlF:
    """verl_F.masked_sum / masked_mean as verl defines them."""

    @staticmethod
    def masked_sum(values, mask, axis=None):
        values = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
        return values.sum() if axis is None else values.sum(axis)

    @staticmethod
    def masked_mean(values, mask, axis=None):
        count = mask.sum() if axis is None else mask.sum(axis)
        return VerlF.masked_sum(values, mask, axis) / (count + 1e-8)


@pytest.fixture(scope="module")
def verl() -> dict:
    tree = ast.parse(Path(SOURCE).read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            node.returns = None
            for arg in node.args.args + node.args.kwonlyargs:
                arg.annotation = None
            keep.append(node)
        elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") in CONSTANTS:
            keep.append(ast.copy_location(ast.Assign([node.target], node.value), node))
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in CONSTANTS:
            keep.append(node)
    names = {"torch": torch, "math": math, "verl_F": VerlF, "Optional": None, "Any": None}
    exec(compile(ast.fix_missing_locations(ast.Module(keep, [])), SOURCE, "exec"), names)
    assert FUNCTIONS <= set(names), sorted(FUNCTIONS - set(names))
    return names


def batches(n: int):
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        rows, cols = 2 + i % 5, 1 + i % 9
        trainer = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 4
        rollout = trainer + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * (0.05 + i / 150)
        mask = (torch.rand(rows, cols, generator=gen) > 0.3).double()
        mask[:, 0] = 1
        yield i, trainer, rollout, mask


def test_the_metrics_equal_verls_up_to_its_epsilon(verl):
    for _, trainer, rollout, mask in batches(200):
        theirs = verl["compute_offpolicy_metrics"](trainer, rollout, mask)
        ours = mismatch_metrics(trainer, rollout, mask)
        for key in ("kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff",
                    "ppl_ratio", "chi2_token", "chi2_seq"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-9), key


def test_weights_and_rejection_masks_equal_verls_exactly(verl):
    for i, trainer, rollout, mask in batches(300):
        level = ("token", "sequence")[i % 2]
        theirs, _ = verl["compute_rollout_correction_weights"](trainer - rollout, mask, rollout_is=level,
                                                               rollout_is_threshold=2.0)
        assert torch.equal(importance_weights(trainer, rollout, mask, level=level, threshold=2.0), theirs)
        option = RS_OPTIONS[i % len(RS_OPTIONS)]
        threshold = "0.7_1.5" if option.endswith("k1") else 0.05
        theirs, _ = verl["compute_rollout_rejection_mask"](trainer - rollout, mask, rollout_rs=option,
                                                           rollout_rs_threshold=threshold)
        assert torch.equal(rejection_mask(trainer, rollout, mask, rollout_rs=option, threshold=threshold),
                           theirs), option
