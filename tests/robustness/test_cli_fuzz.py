"""Fuzzed command-line options (hypothesis): whatever the values, the CLI answers with a result
or a one-line error (exit 0, 1 or 2), never a traceback, a hang or a crash."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NUMBERS = st.one_of(
    st.integers(min_value=-10**40, max_value=10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "0", "-0", "9" * 5000, "", "0x10", "1,2"]),
    st.text(max_size=12),
)
FORMATS = st.sampled_from(["mxfp4", "nvfp4", "int4", "mxfp8_e4m3", "mxfp5", "", "MXFP4"])
THRESHOLD_KEYS = st.sampled_from(["sqnr_db", "deadzone", "saturation", "relative_error", "sqnr"])
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
_runs = itertools.count()


def assert_clean(result) -> None:
    assert result.rc in (0, 1, 2), f"rc {result.rc}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    if result.rc == 2:
        assert "error:" in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]


@pytest.fixture(scope="module")
def report(cli, models, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "scan"
    result = cli("scan", models["qwen2"], "--format", "mxfp4", "--out", out)
    assert result.rc == 0, result.stderr
    return out


@SETTINGS
@given(tiers=st.lists(NUMBERS, min_size=1, max_size=3), steps=NUMBERS, aqn=st.booleans())
def test_guide_options(cli, report, tmp_path, tiers, steps, aqn):
    argv = ["guide", report, "--out", tmp_path / f"p{next(_runs)}.json", "--tiers", ",".join(tiers),
            "--total-steps", steps, *(["--aqn"] if aqn else [])]
    assert_clean(cli(*argv, timeout=60))


@SETTINGS
@given(fmt=FORMATS, block=NUMBERS, key=THRESHOLD_KEYS, value=NUMBERS)
def test_scan_options(cli, models, tmp_path, fmt, block, key, value):
    argv = ["scan", models["qwen2"], "--format", fmt, "--block-size", block, "--threshold",
            f"{key}={value}", "--out", tmp_path / f"s{next(_runs)}"]
    assert_clean(cli(*argv, timeout=60))
