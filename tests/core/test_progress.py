"""Progress on stderr: a bar on a terminal, plain lines elsewhere, nothing when turned off."""

from __future__ import annotations

import io

import pytest

from qtransform.core import progress as progress_mod
from qtransform.core.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_a_line_at_every_tenth_and_one_at_the_end():
    out = io.StringIO()
    for _ in Progress(range(25), desc="scan", unit="batch", enabled=None, stream=out):
        pass
    lines = out.getvalue().splitlines()
    done = [int(line.split()[1]) for line in lines[:-1]]
    assert done == [3, 6, 9, 12, 15, 18, 21, 24]  # each time 10 % more is done (2.5 batches)
    assert lines[0].startswith("scan: 3 of 25 batches (12 %), 0 s, about 0 s left")
    assert lines[-1] == "scan: done, 25 batches in 0 s"


def test_a_line_every_thirty_seconds_of_slow_work(monkeypatch):
    clock = iter(range(0, 10_000, 31))  # every update 31 s after the last
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with Progress(total=1000, desc="weights", unit="param", unit_scale=True, enabled=None, stream=out) as bar:
        bar.update(1)
        bar.update(2)
    lines = out.getvalue().splitlines()
    assert lines == ["weights: 1 of 1.0k params (0 %), 31 s, about 8 h 36 min left",
                     "weights: 3 of 1.0k params (0 %), 1 min 02 s, about 5 h 43 min left",
                     "weights: done, 3 params in 1 min 33 s"]


def test_off_is_silent_and_a_failure_has_no_done_line():
    out = io.StringIO()
    for _ in Progress(range(10), desc="scan", enabled=False, stream=out):
        pass
    assert out.getvalue() == ""
    with pytest.raises(RuntimeError), Progress(total=4, desc="scan", enabled=None, stream=out) as bar:
        bar.update(2)
        raise RuntimeError
    assert out.getvalue().splitlines() == ["scan: 2 of 4 its (50 %), 0 s, about 0 s left"]


@pytest.mark.parametrize("enabled", [None, True])
def test_a_terminal_gets_a_bar_and_no_lines(enabled):
    out = Terminal()
    for _ in Progress(range(20), desc="scan", unit="site", enabled=enabled, stream=out):
        pass
    text = out.getvalue()
    assert "0/20 [" in text and "site/s" in text  # tqdm (it redraws at most every 0.1 s)
    assert "of 20 sites" not in text and "done," not in text
