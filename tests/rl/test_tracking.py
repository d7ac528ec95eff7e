"""What an RL run logs outside TRL: weight statistics against a hand computation from the format
functions, rl_metrics' keys, and log_to writing to a real tensorboard SummaryWriter."""

from __future__ import annotations

import math

import pytest
import torch

import qtransform
from qtransform.errors import UserError
from qtransform.formats import fake_quantize, saturated
from qtransform.rl import log_to, mismatch_metrics, rl_metrics, weight_stats
from qtransform.rl.tracking import PREFIX
from tests.rl.test_rl_core import POLICY, tiny_qwen2

SITE = "model.layers.1.mlp.down_proj"


def test_weight_statistics_equal_the_hand_computation_and_follow_the_weights():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    layer = model.get_submodule(SITE)
    with torch.no_grad():
        layer.weight[0, :4] = 0.0  # zeros are not deadzone
    for scale in (1.0, 3.0):  # a weight that changed is measured as it is now
        with torch.no_grad():
            layer.weight.mul_(scale)
        stats = weight_stats(model)
        w = layer.weight.detach().double()
        q = fake_quantize(layer.weight.detach(), "nvfp4", axis=-1).double()
        sqnr = 10 * math.log10(float((w * w).sum() / ((w - q) ** 2).sum()))
        nonzero = w != 0
        dead = int(((q == 0) & nonzero).sum()) / int(nonzero.sum())
        sat = float(saturated(layer.weight.detach(), "nvfp4", axis=-1).double().mean())
        key = f"{PREFIX}weights/{SITE}"
        assert stats[f"{key}/sqnr_db"] == pytest.approx(sqnr, rel=1e-9)
        assert stats[f"{key}/deadzone"] == pytest.approx(dead, abs=1e-12)
        assert stats[f"{key}/saturation"] == pytest.approx(sat, abs=1e-12)
    sites = {k.split("/")[2] for k in stats if k.count("/") == 3}
    assert len(sites) == 14  # 7 linears in each of 2 layers; lm_head is ignored
    assert stats[f"{PREFIX}weights/min_sqnr_db"] == min(
        v for k, v in stats.items() if k.endswith("/sqnr_db") and k.count("/") == 3)


def test_rl_metrics_holds_sigma_counters_and_mismatch():
    model = qtransform.transform(tiny_qwen2(), POLICY)
    qtransform.noise_controller(model).set_step(20)
    trainer = torch.log(torch.tensor([[0.5, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25]]))
    out = rl_metrics(model, trainer_logp=trainer, rollout_logp=rollout)
    assert out[f"{PREFIX}sigma"] == pytest.approx(0.05 * 0.1 ** 0.5)  # interval 2 of 4
    assert out[f"{PREFIX}step"] == 20.0
    for key, value in mismatch_metrics(trainer, rollout).items():
        assert out[f"{PREFIX}mismatch/{key}"] == value
    assert not any("/weights/" in k for k in out)
    with pytest.raises(UserError, match="both"):
        rl_metrics(model, trainer_logp=trainer)


def test_log_to_writes_a_tensorboard_event_file(tmp_path):
    writer_mod = pytest.importorskip("torch.utils.tensorboard")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    writer = writer_mod.SummaryWriter(log_dir=str(tmp_path))
    log_to(writer, {"qtransform/sigma": 0.25, "qtransform/mismatch/kl": -0.5}, step=7)
    writer.close()
    acc = accumulator.EventAccumulator(str(tmp_path)).Reload()
    assert [(e.step, e.value) for e in acc.Scalars("qtransform/sigma")] == [(7, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("qtransform/mismatch/kl")] == [(7, -0.5)]

    seen = []
    log_to(lambda metrics, step: seen.append((metrics, step)), {"a": 1.0}, step=3)
    assert seen == [({"a": 1.0}, 3)]
    with pytest.raises(UserError, match="SummaryWriter"):
        log_to(object(), {"a": 1.0}, step=0)
