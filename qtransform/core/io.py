"""Reading inputs and writing outputs safely: the one place every command's files go through.

Reports, policies and plots are read by other tools (and by the next run) while experiments are
still going; a reader must see either the old file or the complete new one, never half a file from
an interrupted run. Every single file goes through a temporary file in the destination folder
(same file system) followed by `os.replace`, which is atomic on POSIX.

A command that writes a folder of files (`transform`, `scan`, `compare`, the demo) writes them into
a fresh staging folder beside the destination and swaps it in as a whole, with a manifest
(`MANIFEST`) that names the command and its files. A folder is only ever replaced when it is empty
or carries the manifest of the same command (a previous output): anything else is refused unless
the user says `--force`, so a mistyped `--out` can never delete unrelated files. Targets are
checked before any expensive work (file or folder, writable parent, not an input of the run),
concurrent runs on one target are serialized by a lock file, and SIGINT/SIGTERM unwind through the
same cleanup code as an error (`install_signal_handlers`), so no temporary file is left behind.

Inputs are checked the other way round: a path must be a regular file of bounded size before it
is opened, so a FIFO or `/dev/zero` given as a model or calibration file fails at once.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from qtransform.errors import UserError

MANIFEST = ".qtransform-output.json"
MAX_TEXT_BYTES = 256 * 2**20  # policies, calibration files, reports, config.json


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -- signals -------------------------------------------------------------------------------------
class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that every cleanup handler runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def install_signal_handlers() -> None:
    """Turn SIGINT/SIGTERM/SIGHUP into `Interrupted`; later signals are ignored so the cleanup
    that the first one started (removing staging folders) runs to the end."""
    state = {"seen": False}

    def handler(signum: int, frame: FrameType | None) -> None:  # noqa: ARG001
        if state["seen"]:
            return
        state["seen"] = True
        raise Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# -- inputs --------------------------------------------------------------------------------------
def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_input_file(path: str | os.PathLike[str], what: str,
                     limit: int | None = MAX_TEXT_BYTES) -> Path:
    """`path` as a Path when it is a regular file of at most `limit` bytes; else a UserError that
    says what it is instead (missing, dangling symlink, folder, FIFO, device, too large)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        if p.is_symlink():
            raise UserError(f"{p}: {what} is a dangling symlink (its target "
                            f"{os.readlink(p)!r} does not exist); fix the link or give the file") from None
        raise UserError(f"{p}: no such {what}") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read {what}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{p}: {what} is {_kind(st.st_mode)}, not a regular file; give a file")
    if limit is not None and st.st_size > limit:
        raise UserError(f"{p}: {what} is {st.st_size / 2**20:.0f} MiB, more than the "
                        f"{limit / 2**20:.0f} MiB limit; give a smaller file")
    return p


def read_input_bytes(path: str | os.PathLike[str], what: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (also if it grows while read)."""
    p = check_input_file(path, what, limit)
    try:
        with open(p, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise UserError(f"{p}: cannot read {what}: {exc.strerror}") from None
    if len(data) > limit:
        raise UserError(f"{p}: {what} is larger than the {limit / 2**20:.0f} MiB limit")
    return data


def read_input_text(path: str | os.PathLike[str], what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of a regular file; bytes that are not UTF-8 are a UserError with the offset."""
    data = read_input_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: {what} is not UTF-8 text (invalid byte at offset {exc.start}); "
                        "save it as UTF-8") from None


# -- output targets ------------------------------------------------------------------------------
def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _check_parent(dest: Path) -> None:
    """The destination's parent must be (or become) a writable folder; checked before the work."""
    parent = dest.parent
    existing = parent
    while not existing.exists():
        if existing.is_symlink():
            raise UserError(f"{dest}: {existing} is a dangling symlink; fix it or choose another path")
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{dest}: {existing} is a file, not a folder; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{dest}: folder {existing} is not writable; choose a writable path")


def check_file_target(path: str | os.PathLike[str]) -> Path:
    """A path a single file may be written to: absent or a regular file, in a writable folder."""
    dest = Path(path)
    if dest.is_dir():
        raise UserError(f"{dest}: is a folder; give a file path such as {dest / 'out.json'}"
                        f" (the suffix the command writes)")
    if dest.exists() or dest.is_symlink():
        try:
            st = dest.stat()
        except FileNotFoundError:
            raise UserError(f"{dest}: is a dangling symlink; remove it or choose another path") from None
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{dest}: is {_kind(st.st_mode)}; only a regular file is replaced, "
                            "choose another path")
    _check_parent(dest)
    return dest


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path for `path` in a private folder beside it; on success it replaces
    `path`, on error it is removed (`atomic_files` without companions).

    The temporary file has the destination's name, so writers that pick the file type from the
    extension (matplotlib's `savefig`, `onnx.save`) behave as if they wrote `path` itself.
    """
    with atomic_files(path) as folder:
        yield folder / Path(path).name


@contextmanager
def atomic_files(path: str | os.PathLike[str], *companions: str) -> Iterator[Path]:
    """`atomic_path` for a file that comes with companion files beside it (an ONNX model and its
    external data, which the model names by file name): yield a private temporary folder beside
    `path` in which the writer creates `path`'s name and any of the `companions` (file names).

    On success the companions written are moved into place first and `path` last, so a reader
    that opens `path` finds its companions; a companion not written is removed from the
    destination (the stale companion of an older file). On error nothing at the destination
    changes and the temporary folder is removed.
    """
    dest = check_file_target(path)
    for name in companions:
        check_file_target(dest.parent / name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        yield tmp
        mode = 0o666 & ~current_umask()  # mkdtemp's folder is private; the files should not be
        for written in tmp.iterdir():
            os.chmod(written, mode)
        written = [name for name in companions if (tmp / name).exists()]
        for name in written:
            check_file_target(dest.parent / name)
            os.replace(tmp / name, dest.parent / name)
        check_file_target(dest)  # again: something may have appeared there during the work
        os.replace(tmp / dest.name, dest)
        for name in companions:
            if name not in written:
                (dest.parent / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def target_lock(dest: Path) -> Iterator[None]:
    """An exclusive lock on `dest` for this process (a lock file beside it, removed afterwards);
    a second run on the same target gets a UserError instead of racing the first."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = dest.parent / f".{dest.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666 & ~current_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise UserError(f"{dest}: in use by another qtransform run (lock {lock}); wait for "
                                "it to finish or choose another --out") from None
            raise
        try:  # the holder before us may have removed the file we opened: lock the current one
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def output_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Check a single-file `--out` before the work and hold its lock during it; the command
    writes `path` itself through `atomic_path` (or `write_*`)."""
    dest = check_file_target(path)
    with target_lock(dest):
        yield dest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a folder this tool wrote, or None (absent or not ours)."""
    try:
        data = json.loads((folder / MANIFEST).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("command"), str) else None


def check_folder_target(path: str | os.PathLike[str], command: str, *, force: bool = False,
                        protect: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """A folder `command` may (re)write: absent, empty, or a previous output of `command` (its
    manifest says so); with `force`, any folder that holds none of the run's inputs (`protect`)
    nor the working directory."""
    dest = Path(path)
    if dest.is_symlink() and not dest.exists():
        raise UserError(f"{dest}: is a dangling symlink; remove it or choose another --out")
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest}: is a file, but --out names a folder here; give a folder path")
    full = Path(os.path.realpath(dest))
    if _inside(Path.cwd().resolve(), full):
        raise UserError(f"{dest}: is the working directory or contains it; give a new folder path "
                        "for --out")
    for item in protect:
        src = Path(os.path.realpath(item))
        if _inside(src, full) or _inside(full, src):
            raise UserError(f"{dest}: overlaps the input {item}; give a separate --out folder")
    _check_parent(dest)
    if dest.is_dir():
        if not os.access(dest, os.W_OK | os.X_OK):
            raise UserError(f"{dest}: folder is not writable; choose a writable path")
        manifest = read_manifest(dest)
        empty = not any(dest.iterdir())
        if not (empty or force or (manifest is not None and manifest["command"] == command)):
            what = (f"the output of `qtransform {manifest['command']}`" if manifest
                    else "a folder that qtransform did not write")
            raise UserError(f"{dest}: exists and is {what}; its contents would be replaced: "
                            "give a new --out path, or --force to replace it")
    return dest


@contextmanager
def output_folder(path: str | os.PathLike[str], command: str, *, force: bool = False,
                  protect: Iterable[str | os.PathLike[str]] = ()) -> Iterator[Path]:
    """Check `path` (see `check_folder_target`), then yield a fresh staging folder beside it.

    On success the staging folder gets the manifest and the umask's permissions and is swapped in
    for `path` as a whole (the old folder is removed only after the new one is in place); on an
    error or a signal it is removed and `path` is left as it was.
    """
    dest = check_folder_target(path, command, force=force, protect=protect)
    with target_lock(dest):
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
        try:
            yield staging
            files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
            write_json(staging / MANIFEST, {"command": command, "complete": True, "files": files})
            os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's 0700 is not what mkdir gives
            check_folder_target(dest, command, force=force, protect=protect)
            _swap(staging, dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _swap(staging: Path, dest: Path) -> None:
    """Put `staging` at `dest`; an old `dest` is moved aside first and removed afterwards."""
    if not dest.exists():
        os.replace(staging, dest)
        return
    old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
    os.replace(dest, old)  # onto the empty folder mkdtemp made: allowed for directories
    try:
        os.replace(staging, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


# -- writers -------------------------------------------------------------------------------------
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


def write_json(path: str | os.PathLike[str], obj: object, *, indent: int = 2) -> Path:
    """Atomically write `obj` as strict JSON (NaN/Infinity are rejected: encode them first)."""
    return write_text(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


def encode_floats(obj: object) -> Any:
    """Strict-JSON copy of obj: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_floats(v) for v in obj]
    return obj
