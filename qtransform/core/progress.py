"""Progress of long work on stderr: a bar on a terminal, plain lines everywhere else.

A scan of a real model runs for minutes. On a terminal a tqdm bar shows it; when stderr is a
file or a pipe (a batch job, CI, `2> log`) a bar is noise or nothing, and a run that prints
nothing for twelve minutes looks hung. There, progress is a line now and then: at every tenth of
the work and at least every `LINE_SECONDS`, and one when the work ends.

`enabled`: True always shows a bar, False shows nothing, None (what the CLI passes unless
`--no-progress`) a bar on a terminal and lines elsewhere.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm

LINE_SECONDS = 30.0  # without a terminal: a line at least this often
LINE_SHARE = 0.1  # ... and one each time this share of the work is done


def _count(n: float, scale: bool) -> str:
    if not scale:
        return f"{n:g}"
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.1f}{suffix}"
    return f"{n:g}"


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Progress:
    """Progress over `total` units (`update(n)`), or over an iterable (`for x in Progress(...)`)."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: float | None = None,
                 desc: str, unit: str = "it", unit_scale: bool = False,
                 enabled: bool | None = False, stream: TextIO | None = None):
        if total is None and iterable is not None:
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable = iterable
        self.total = float(total or 0)
        self.desc, self.unit, self.unit_scale = desc, unit, unit_scale
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0.0
        self._bar = None
        self._lines = False
        if enabled or (enabled is None and self.stream.isatty()):
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                             file=self.stream, leave=False)
        elif enabled is None:
            self._lines = True
        self._start = self._last_time = time.monotonic()
        self._last_share = 0.0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(finished=exc[0] is None)

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        except BaseException:
            self.close(finished=False)
            raise
        self.close()

    def update(self, n: float = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self._lines:
            now = time.monotonic()
            share = self.done / self.total if self.total else 0.0
            due = share - self._last_share >= LINE_SHARE - 1e-9 or now - self._last_time >= LINE_SECONDS
            if due and share < 1:  # the end has its own line (`close`)
                self._line(now, share)

    def _line(self, now: float, share: float) -> None:
        elapsed = now - self._start
        text = (f"{self.desc}: {_count(self.done, self.unit_scale)} of "
                f"{_count(self.total, self.unit_scale)} {_plural(self.unit)} ({100 * share:.0f} %), "
                f"{_duration(elapsed)}")
        if 0 < share < 1:
            text += f", about {_duration(elapsed * (1 - share) / share)} left"
        print(text, file=self.stream, flush=True)
        self._last_time, self._last_share = now, share

    def close(self, finished: bool = True) -> None:
        """End the bar; without a terminal, a last line says the work is done (once)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._lines:
            self._lines = False
            if finished:
                print(f"{self.desc}: done, {_count(self.done, self.unit_scale)} {_plural(self.unit)} in "
                      f"{_duration(time.monotonic() - self._start)}", file=self.stream, flush=True)
