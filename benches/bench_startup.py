"""Where the CLI's start-up time goes: the `qtransform` façade, the command modules, `--help`.

`qtransform.cli.main` lives inside the `qtransform` package, so Python imports the façade (torch,
every stage) before any command module; a first-party import deferred into a command function
then saves nothing. Each run is a fresh process; the table shows medians over the runs.

    .venv/bin/python benches/bench_startup.py            # 7 runs
    .venv/bin/python benches/bench_startup.py --runs 15
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROBE = """
import time
t0 = time.perf_counter()
import qtransform
t1 = time.perf_counter()
from qtransform.cli.main import build_parser
build_parser()
t2 = time.perf_counter()
import sys
print(t1 - t0, t2 - t1, int("transformers" in sys.modules))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    runs = parser.parse_args().runs
    cli = Path(sys.executable).with_name("qtransform")
    facade, commands, helps, loaded = [], [], [], set()
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True, text=True)
        a, b, tf = out.stdout.split()
        facade.append(float(a))
        commands.append(float(b))
        loaded.add(tf == "1")
        start = time.perf_counter()
        subprocess.run([cli, "--help"], check=True, capture_output=True)
        helps.append(time.perf_counter() - start)
    print(f"| what | median of {runs} runs |")
    print("|---|---|")
    print(f"| `import qtransform` (the façade) | {statistics.median(facade):.2f} s |")
    print(f"| then the command modules (`build_parser()`) | {1e3 * statistics.median(commands):.0f} ms |")
    print(f"| `qtransform --help`, the whole process | {statistics.median(helps):.2f} s |")
    print(f"| transformers loaded at start-up | {'yes' if True in loaded else 'no'} |")


if __name__ == "__main__":
    main()
