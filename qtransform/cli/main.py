"""The `qtransform` command: one argparse tree, one module per command group.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. User mistakes raise `UserError` (exit 2, no traceback unless --debug); any
other exception is a bug of qtransform's own and says so (exit 3, with its traceback).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback

from qtransform.core.io import Interrupted, install_signal_handlers
from qtransform.errors import UserError

COMMAND_MODULES = ("model", "policy", "scan", "sensitivity", "export", "parity", "report")
INTERNAL_ERROR = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qtransform",
        description="Fake-quantize, instrument and noise LLMs on torch.fx, driven by a JSON policy.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"qtransform.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. The error boundary: a UserError (or an OS error about the user's files,
    such as a full disk) is one line on stderr and exit 2; SIGINT/SIGTERM unwind through every
    cleanup handler (temporary files are removed) and exit 128 + the signal number; anything else
    is an internal error: its traceback, a last line saying it is a bug to report, exit 3."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None:  # the real command, not a call from Python code that owns its signals
        install_signal_handlers()
        quiet_transformers()
    try:
        return int(args.func(args) or 0)
    except (UserError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print("interrupted", file=sys.stderr)
        return 128 + (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)
    except Exception as exc:
        if args.debug:
            raise
        traceback.print_exc()
        print(f"internal error: {type(exc).__name__} in qtransform itself, not a mistake in your "
              "input; please report it with the traceback above", file=sys.stderr)
        return INTERNAL_ERROR


def quiet_transformers() -> None:
    """transformers' advice about configs would bury the one line an error promises; so would
    torchao's warnings, which transformers imports where it is installed (its GPU-only kernels
    fail to load on CPU, and torch warns about its enum registrations)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _one_line(exc: BaseException) -> str:
    """An OS error as `path: reason` (its str() repeats the errno); a UserError as written (a
    policy error lists one problem per line, by design)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else "error"
        return f"{where}: {exc.strerror}; check the path and its permissions"
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
