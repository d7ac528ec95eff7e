"""`qtransform policy`: validate a policy file, print its JSON Schema, explain it in words."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qtransform.schemas import Policy, PolicyError, Problem, from_legacy_srdd, load_policy
from qtransform.schemas.explain import explain, fields, summary
from qtransform.schemas.generate import schema_text
from qtransform.schemas.loading import MAX_POLICY_BYTES, parse_json, validate_policy
from qtransform.schemas.presets import PRESETS, preset_names

_RAW = argparse.RawDescriptionHelpFormatter

VALIDATE_EPILOG = """\
examples:
  qtransform policy validate schemas/examples/w4a16_mxfp4.json
  qtransform policy validate my_policy.json --json > normalized.json
  qtransform policy validate srdd_sigma.json --legacy --total-steps 174 --json > policy.json

exit status: 0 valid, 2 invalid (every problem is listed with its JSON path)."""

SCHEMA_EPILOG = """\
example:
  qtransform policy schema > policy.schema.json   # for editor completion and CI checks"""

EXPLAIN_EPILOG = """\
examples:
  qtransform policy explain schemas/examples/qerl_aqn.json
  qtransform policy explain schemas/examples/qerl_aqn.json --fields   # every setting, explained"""


PRESETS_EPILOG = """\
example:
  qtransform policy presets
  echo '{"preset": "llm-compressor/NVFP4"}' | qtransform policy explain -   # its rules in words"""


def _add_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="policy JSON file ('-' reads stdin)")
    parser.add_argument(
        "--legacy",
        action="store_true",
        help='FILE is a legacy SRDD sigma config ({"base_sigma": ..., "layer_multipliers": ...})',
    )
    parser.add_argument(
        "--total-steps",
        type=int,
        metavar="N",
        help="training length for a legacy config that does not give one (with --legacy)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "policy",
        help="validate, explain and print the schema of policy files",
        description="Check policy files before a run: validate, schema, explain.",
    )
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    sub = parser.add_subparsers(dest="policy_command", metavar="SUBCOMMAND")

    validate = sub.add_parser(
        "validate",
        help="check a policy file and list every problem",
        description="Validate FILE; print 'ok: <summary>' or every problem with its JSON path.",
        epilog=VALIDATE_EPILOG,
        formatter_class=_RAW,
    )
    _add_source_args(validate)
    validate.add_argument(
        "--json",
        action="store_true",
        help="print the normalized policy (defaults filled in) as JSON, or the errors as JSON",
    )
    validate.set_defaults(func=_validate)

    schema = sub.add_parser(
        "schema",
        help="print the policy JSON Schema",
        description="Print the JSON Schema of policy files.",
        epilog=SCHEMA_EPILOG,
        formatter_class=_RAW,
    )
    schema.set_defaults(func=lambda args: print(schema_text(), end="") or 0)

    explain_p = sub.add_parser(
        "explain",
        help="say in plain words what a policy will do",
        description="Describe each rule and section of FILE in plain language.",
        epilog=EXPLAIN_EPILOG,
        formatter_class=_RAW,
    )
    _add_source_args(explain_p)
    explain_p.add_argument("--fields", action="store_true",
                           help="also list every setting (defaults filled in) with what it means")
    explain_p.set_defaults(func=_explain)

    presets = sub.add_parser(
        "presets",
        help="list the presets a policy can start from",
        description='List the presets ("preset": "<stack>/<scheme>" in a policy) and what each '
                    "reproduces; docs/recipes.md has their expansions.",
        epilog=PRESETS_EPILOG,
        formatter_class=_RAW,
    )
    presets.set_defaults(func=_presets)


def _read(args: argparse.Namespace) -> Policy:
    """The policy named on the command line (a path, or '-' for stdin), legacy or not."""
    if args.total_steps is not None and not args.legacy:
        raise PolicyError([Problem("--total-steps", "only used with --legacy")])
    if args.file == "-":
        text = sys.stdin.read(MAX_POLICY_BYTES + 1)  # /dev/zero on stdin must not fill memory
        if len(text) > MAX_POLICY_BYTES:
            raise PolicyError([Problem("<stdin>", f"more than {MAX_POLICY_BYTES // 2**20} MiB; "
                                       "a policy is a small JSON document")])
        data = parse_json(text, "<stdin>")
        return (
            from_legacy_srdd(data, total_steps=args.total_steps)
            if args.legacy
            else (validate_policy(data, "<stdin>"))
        )
    if args.legacy:
        return from_legacy_srdd(Path(args.file), total_steps=args.total_steps)
    return load_policy(Path(args.file))


def _validate(args: argparse.Namespace) -> int:
    try:
        policy = _read(args)
    except PolicyError as exc:
        if not args.json:
            raise
        print(json.dumps({"ok": False, "errors": [p.to_dict() for p in exc.problems]}, indent=2))
        return 2
    print(policy.to_json() if args.json else f"ok: {args.file}: {summary(policy)}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    policy = _read(args)
    print(explain(policy))
    if args.file != "-":
        print(_calibrated(Path(args.file).parent), end="")
    if args.fields:
        print("\nSettings:\n" + fields(policy))
    return 0


def _presets(args: argparse.Namespace) -> int:
    for name in preset_names():
        preset = PRESETS[name]
        checked = f" (checked against {preset.checked_against})" if preset.checked_against else ""
        print(f"{name}: {preset.reproduces}{checked}")
        for option in preset.options:
            values = "true/false" if option.choices is None else "/".join(json.dumps(c) for c in option.choices)
            print(f"    preset_options.{option.name} ({values}, default {json.dumps(option.default)}): {option.help}")
    return 0


def _calibrated(folder: Path) -> str:
    """The calibrated static scales saved beside a policy (a `save_transformed` folder), one
    line each: what `qtransform transform --calib` froze."""
    from qtransform.pipeline.saving import (  # not at start-up: `policy` stays light
        SCALES_FILE,
        STORED_SUFFIX,
    )

    path = folder / SCALES_FILE
    if not path.is_file():
        return ""
    from safetensors.torch import load_file

    scales = load_file(str(path))
    lines = [f"\nCalibrated static scales ({len(scales)}, from {SCALES_FILE}; amax of each, or "
             "a checkpoint's stored scale):"]
    lines += [f"  {name.removesuffix(STORED_SUFFIX).removesuffix('.static_scale')}: {value.item():.6g}"
              + (" (stored scale)" if name.endswith(STORED_SUFFIX) else "")
              for name, value in sorted(scales.items())]
    return "\n".join(lines) + "\n"
