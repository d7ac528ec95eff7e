"""The machine a test run ran on, for pytest's header: the CPU and its vector units, the
libraries whose kernels sum in their own order, the threads. Another library's GEMM or
reduction is compared within its rounding (docs/testing.md), and that rounding follows the
CPU: a failure report starts with what the CPU was."""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata

import torch

# the flags that pick GEMM and reduction kernels (x86: SSE to AMX; Arm: NEON, SVE)
VECTOR_FLAGS = re.compile(r"^(sse4_2|avx.*|fma|f16c|amx.*|asimd.*|sve.*|sme(?!p$).*)$")


def cpu() -> tuple[str, list[str]]:
    """(model name, vector flags) from /proc/cpuinfo; the platform's words where there is none."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return platform.processor() or platform.machine(), []
    model = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
    found = sorted({f for f in (flags.group(1).split() if flags else []) if VECTOR_FLAGS.match(f)})
    return (model.group(1).strip() if model else platform.machine()), found


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def header() -> list[str]:
    name, flags = cpu()
    return [
        f"cpu: {name}, {os.cpu_count()} cores; vector flags: {' '.join(flags) or 'none found'}",
        f"torch {torch.__version__} (cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads), onnxruntime {version('onnxruntime')}",
    ]
