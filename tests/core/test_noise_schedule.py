"""AQN schedules: pure functions checked against QeRL's formula and the documented variants."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from qtransform.core.schedule import sigma_at, stage_at, stage_values
from qtransform.schemas import PolicyError, load_policy
from qtransform.schemas import Schedule as ScheduleSpec


def Schedule(kind: str, sigma_start: float, sigma_end: float | None = None, **fields) -> ScheduleSpec:
    """The policy's schedule (the one schedule type), built the way a policy file would."""
    spec = {"kind": kind, "sigma_start": sigma_start, **fields}
    if sigma_end is not None:
        spec["sigma_end"] = sigma_end
    return load_policy({"version": 1, "noise": {"schedule": spec}}).noise.schedule


def qerl_sigma(step: int, total: int, k: int, start: float, end: float) -> float:
    """QeRL's scheme: K-1 values sigma_i = start*(end/start)^(i/(K-2)), K intervals of total/K
    steps, interval 0 noise-free, the last value held past the end. Interval lengths are exact
    fractions here (QeRL divides floats, which can put a boundary step one interval early)."""
    trend = [start * (end / start) ** (i / (k - 2)) for i in range(k - 1)]
    interval = math.floor(Fraction(min(step, total)) / Fraction(total, k))
    return 0.0 if interval == 0 else trend[min(interval - 1, len(trend) - 1)]


@pytest.mark.parametrize("total", [23, 100, 1000])
def test_exponential_equals_qerl_formula_at_every_step(total):
    for k in range(3, 21):
        if total < k:
            continue
        s = Schedule("exponential", 0.01, 0.0001, num_stages=k, total_steps=total)
        first = math.ceil(total / k)  # the first step of interval 1
        for step in range(0, total + total // 2):
            got = sigma_at(step, s)
            assert got == pytest.approx(qerl_sigma(step, total, k, 0.01, 0.0001), rel=1e-12), (k, step)
            if step < first:
                assert got == 0.0
        assert sigma_at(first, s) == 0.01
        assert sigma_at(10 * total, s) == pytest.approx(0.0001)


def test_user_log_example_k10():
    """The users' 58-step run: steps 0-5 noise-free, 6-11 at 0.05, 12-17 at 0.0281."""
    s = Schedule("exponential", 0.05, 0.0005, num_stages=10, total_steps=58)
    assert [sigma_at(t, s) for t in range(6)] == [0.0] * 6
    assert {sigma_at(t, s) for t in range(6, 12)} == {0.05}
    assert {round(sigma_at(t, s), 4) for t in range(12, 18)} == {0.0281}
    assert sigma_at(57, s) == pytest.approx(0.0005)


def test_linear_cosine_constant_stage_values():
    lin = Schedule("linear", 0.01, 0.002, num_stages=6, total_steps=60)
    assert stage_values(lin) == pytest.approx((0.01, 0.008, 0.006, 0.004, 0.002))
    cos = Schedule("cosine", 0.01, 0.002, num_stages=6, total_steps=60)
    values = stage_values(cos)
    assert values[0] == pytest.approx(0.01) and values[-1] == pytest.approx(0.002)
    assert values[2] == pytest.approx(0.006)  # the midpoint of a half cosine
    assert all(a > b for a, b in zip(values[:-1], values[1:], strict=True))
    const = Schedule("constant", 0.003, num_stages=4, total_steps=40)
    assert [sigma_at(t, const) for t in (0, 9, 10, 39, 500)] == [0.0, 0.0, 0.003, 0.003, 0.003]
    assert sigma_at(0, lin) == 0.0 and sigma_at(10, lin) == 0.01 and sigma_at(59, lin) == pytest.approx(0.002)


def test_warmup_shifts_the_clock_and_stages_fill_the_rest():
    s = Schedule("exponential", 0.01, 0.0001, num_stages=4, total_steps=120, warmup_steps=40)
    assert all(sigma_at(t, s) == 0.0 for t in range(60))  # 40 warm-up steps + interval 0 (20)
    assert sigma_at(60, s) == 0.01
    assert sigma_at(100, s) == pytest.approx(0.0001) and sigma_at(119, s) == pytest.approx(0.0001)


def test_per_epoch_restarts_each_epoch_and_holds_after_epochs():
    s = Schedule("exponential", 0.01, 0.0001, steps_per_epoch=30, stages_per_epoch=3, epochs=2)
    one = [sigma_at(t, s) for t in range(30)]
    assert one[:10] == [0.0] * 10 and set(one[10:20]) == {0.01} and one[20:] == pytest.approx([0.0001] * 10)
    assert [sigma_at(t, s) for t in range(30, 60)] == one
    assert sigma_at(60, s) == sigma_at(500, s) == pytest.approx(0.0001)
    forever = Schedule("exponential", 0.01, 0.0001, steps_per_epoch=30, stages_per_epoch=3)
    assert sigma_at(95, forever) == 0.0 and sigma_at(100, forever) == 0.01


def test_invalid_schedules_are_policy_errors():
    with pytest.raises(PolicyError, match="sigma_end"):
        Schedule("exponential", 0.2, 0.0, num_stages=5, total_steps=100)
    with pytest.raises(PolicyError, match="3 stages"):
        Schedule("exponential", 0.2, 0.01, num_stages=2, total_steps=100)
    with pytest.raises(PolicyError, match="total_steps"):
        Schedule("linear", 0.2, 0.01, num_stages=4)


def test_schedule_from_policy():
    s = Schedule("cosine", 0.02, 0.001, steps_per_epoch=50, stages_per_epoch=5, warmup_steps=3)
    assert (s.kind, s.stages, s.per_epoch, s.warmup_steps) == ("cosine", 5, True, 3)
    assert Schedule("exponential", 0.01, 0.0001, total_steps=100).stages == 10


@pytest.mark.parametrize(("fields", "where", "message"), [
    ({"kind": "exp"}, "kind", "exponential"),
    ({"steps_per_epoch": 5, "stages_per_epoch": 2}, "total_steps", "not both"),
    ({"total_steps": None, "steps_per_epoch": 5}, "stages_per_epoch", "go together"),
    ({"num_stages": 1}, "num_stages", "at least 2 stages"),
    ({"warmup_steps": -1}, "warmup_steps", ""),
    ({"warmup_steps": 10}, "warmup_steps", "leaves no step to train"),
    ({"total_steps": None, "num_stages": None, "steps_per_epoch": 5, "stages_per_epoch": 2,
      "epochs": 3, "warmup_steps": 15}, "warmup_steps", "leaves no step to train (15 in all)"),
    ({"sigma_end": None}, "sigma_end", "required by a linear schedule"),
    ({"sigma_start": -0.1}, "sigma_start", ""),
    ({"sigma_end": -0.1}, "sigma_end", ""),
    ({"kind": "exponential", "num_stages": 2}, "num_stages", "at least 3 stages"),
    ({"kind": "exponential", "sigma_end": 0.0}, "sigma_end", "silently stops"),
])
def test_each_schedule_problem_names_its_field(fields, where, message):
    """One validation for policies and for direct users of the pure functions."""
    base = {"kind": "linear", "sigma_start": 0.1, "sigma_end": 0.01, "num_stages": 3,
            "total_steps": 10}
    spec = {k: v for k, v in {**base, **fields}.items() if v is not None}
    with pytest.raises(PolicyError) as err:
        load_policy({"version": 1, "noise": {"schedule": spec}})
    assert f"noise.schedule.{where}" in str(err.value) and message in str(err.value)


def test_schedules_at_the_edges_of_validity():
    base = {"sigma_start": 0.1, "sigma_end": 0.01, "num_stages": 3, "total_steps": 10}
    assert Schedule("linear", **{**base, "num_stages": 2, "warmup_steps": 8}).stages == 2
    assert Schedule("constant", 0.1, num_stages=2, total_steps=10).stages == 2
    s = Schedule("exponential", **base, warmup_steps=4)
    assert [stage_at(t, s) for t in (3, 4, 5, 6, 9, 50)] == [None, 0, 0, 1, 2, 2]
    e = Schedule("exponential", 0.1, 0.01, steps_per_epoch=6, stages_per_epoch=3, epochs=2)
    assert [stage_at(t, e) for t in (0, 1, 2, 5, 6, 11, 12, 99)] == [0, 0, 1, 2, 0, 2, 2, 2]
