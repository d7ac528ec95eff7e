"""The protocol every result a run saves follows: `save` it into a folder, `load` it back, and
its `markdown` text, the same after the round trip.

Scan reports, format comparisons, sensitivity reports, run comparisons (`qtransform.scan`) and
parity reports (`qtransform.rl`) implement it; it sits in the core layer, below both, so either
package can name it. Structural (`typing.Protocol`): a result needs no base class.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol, Self, runtime_checkable

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@runtime_checkable
class Result(Protocol):
    def save(self, out: str | os.PathLike[str]) -> dict[str, Path]:
        """Write the result's files into the folder `out` (created); their paths by kind."""
        ...

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Read a result back from its JSON file or the folder `save` wrote."""
        ...

    def markdown(self) -> str:
        """The result as Markdown (what `save` writes as its .md file)."""
        ...


def decode_numbers(obj: object) -> Any:
    """The inverse of `core.io.encode_floats` for numeric fields: "inf", "-inf" and "nan" become
    floats again, in nested dicts and lists (apply it to numbers only, never to free text)."""
    if isinstance(obj, str):
        return _NON_FINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode_numbers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_numbers(v) for v in obj]
    return obj


def json_file(path: str | os.PathLike[str], name: str) -> Path:
    """`path`, or the file `name` inside it when `path` is a folder."""
    p = Path(path)
    return p / name if p.is_dir() else p
