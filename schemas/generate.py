"""Regenerate schemas/policy.schema.json from the models.

python -m qtransform.schemas.generate           # rewrite the file
python -m qtransform.schemas.generate --check   # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .policy import Policy

SCHEMA_PATH = Path(__file__).with_name("policy.schema.json")


def schema() -> dict[str, Any]:
    """The JSON Schema of a policy file (draft 2020-12, as pydantic writes it)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **Policy.model_json_schema()}


def schema_text() -> str:
    return json.dumps(schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed file is stale")
    args = parser.parse_args(argv)
    text = schema_text()
    if args.check:
        current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else ""
        if current != text:
            print(
                f"{SCHEMA_PATH} is stale; run python -m qtransform.schemas.generate",
                file=sys.stderr,
            )
            return 1
        return 0
    SCHEMA_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
