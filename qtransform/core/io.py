"""Atomic file writes.

Reports, policies and plots are read by other tools (and by the next run) while experiments are
still going; a reader must see either the old file or the complete new one, never half a file from
an interrupted run. Every writer goes through a temporary file in the destination folder (same
file system) followed by `os.replace`, which is atomic on POSIX and Windows.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed.

    The temporary name keeps the destination's suffix, so writers that pick the file type from the
    extension (matplotlib's `savefig`, `onnx.save`) behave as if they wrote `path` itself.
    """
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.stem}.", suffix=f".tmp{dest.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if tmp.exists():
            os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp creates 0600; match a plain open()
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Atomically write `data` to `path` (flushed and fsynced before the rename)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return Path(path)


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Atomically write `text` to `path`."""
    return write_bytes(path, text.encode(encoding))


def write_json(path: str | os.PathLike[str], obj: Any, *, indent: int = 2) -> Path:
    """Atomically write `obj` as strict JSON (NaN/Infinity are rejected: encode them first)."""
    return write_text(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


def encode_floats(obj: Any) -> Any:
    """Strict-JSON copy of obj: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_floats(v) for v in obj]
    return obj
