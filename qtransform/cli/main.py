"""The `qtransform` command: one argparse tree, one module per command group.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`func(args) -> int`. User mistakes raise `UserError` (exit 2, no traceback unless --debug).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qtransform.errors import UserError

COMMAND_MODULES = ("model", "policy", "scan", "export")


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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
