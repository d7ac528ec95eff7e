"""`qtransform report A B ...`: result folders side by side (`qtransform.report_runs`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qtransform.report.runs import PAGE, report_runs
from qtransform.scan.runs import DEFAULT_THRESHOLD_DB, FILES

EPILOG = """examples:
  qtransform report scans/mxfp4 scans/nvfp4 --out cmp/formats
  qtransform report before/ after/ --label before --label after --threshold 0.5 --out cmp/training
  qtransform report sens/mxfp4 sens/nvfp4 --out cmp/sensitivity

Every later run is compared with the first: per-site deltas (later minus first), the sites that
got worse or better by more than --threshold dB, and (scans) the flags that appear or disappear.
Results must be of one kind (scan, sensitivity or parity) and of one model.
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="result folders side by side: deltas, what got worse or better",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="result folders (or report.json / sensitivity.json / parity.json); the "
                        "first is the baseline")
    p.add_argument("--out", required=True, help="folder for comparison.json, .md and .html")
    p.add_argument("--label", action="append", default=None,
                   help="a short name per result, in order (default: the folder names)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_DB,
                   help=f"dB a site must move to count as worse or better (default {DEFAULT_THRESHOLD_DB:g})")
    p.add_argument("--force", action="store_true", help="replace --out even when qtransform did not write it")
    p.add_argument("--json", action="store_true", help="print comparison.json on stdout")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    result = report_runs(args.results, args.out, labels=args.label, threshold_db=args.threshold,
                         force=args.force)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.markdown().rstrip())
        print(f"\nwrote {', '.join(str(Path(args.out) / f) for f in (*FILES, PAGE))}")
    return 0
