"""What the HTML pages cost: their size, and the time writing one adds to a CLI run.

Sizes: the weight-scan and activation-scan pages of a 28-layer synthetic Qwen2 (hidden 64: the
page's size depends on the number of sites, not on their width) and of the demo's folder when
given (`--demo FOLDER`, as `qtransform scan --out FOLDER` wrote it). Time: the scan itself and then
writing its page (plotly imported, plotly.js compressed, histograms computed) in one fresh process
per run, on the tiny 2-layer model the tests use, medians over the runs.

    .venv/bin/python benches/bench_report.py
    .venv/bin/python benches/bench_report.py --demo qtransform-demo --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, sys, time
from pathlib import Path
from qtransform.models import build_tiny
from qtransform.scan.weights import scan_weights
from qtransform.report.scan_pages import write_scan_page
model = build_tiny("qwen2", num_layers=2)
t0 = time.perf_counter()
report = scan_weights(model, "mxfp4")
report.save(sys.argv[1])
t1 = time.perf_counter()
write_scan_page(report, Path(sys.argv[1]) / "report.html", source=model)
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1]))
"""


def synthetic_sizes(folder: Path) -> dict[str, int]:
    """Page sizes of a 28-layer synthetic Qwen2: weight scan, activation scan (weights + outputs)."""
    import torch

    from qtransform.models import build_tiny
    from qtransform.report.scan_pages import write_scan_page
    from qtransform.scan.activations import scan_activations
    from qtransform.scan.weights import scan_weights

    model = build_tiny("qwen2", num_layers=28)
    weights = scan_weights(model, "mxfp4")
    policy = {"version": 1, "quantize": [{"name": "w", "targets": ["Linear"], "format": "mxfp4",
                                          "tensors": ["weight"]}]}
    ids = torch.randint(1, 200, (4, 16), generator=torch.Generator().manual_seed(0)).tolist()
    acts = scan_activations(model, policy, ids)
    return {f"28-layer weight scan ({len(weights.rows)} rows)":
            write_scan_page(weights, folder / "w.html", source=model).stat().st_size,
            f"28-layer activation scan ({len(acts.rows)} rows)":
            write_scan_page(acts, folder / "a.html", source=model).stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--demo", type=Path, help="a demo output folder: its pages' sizes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = synthetic_sizes(Path(tmp))
        if args.demo:
            sizes |= {f"demo {p.relative_to(args.demo)}": p.stat().st_size
                      for p in sorted(args.demo.rglob("*.html"))}
        scan, page = [], []
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            res = subprocess.run([sys.executable, "-c", PROBE, str(out)], check=True,
                                 capture_output=True, text=True)
            s, p = json.loads(res.stdout.strip().splitlines()[-1])
            scan.append(s)
            page.append(p)
    print("| page | bytes | MB |\n|---|---|---|")
    for name, size in sizes.items():
        print(f"| {name} | {size} | {size / 1e6:.2f} |")
    print(f"\ntiny qwen2 (2 layers), medians of {args.runs} fresh processes: weight scan and its "
          f"files {statistics.median(scan):.2f} s, then the page {statistics.median(page):.2f} s")


if __name__ == "__main__":
    main()
