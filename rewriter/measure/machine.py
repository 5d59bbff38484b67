"""The machine a measurement ran on, as timings, training reports and benchmarks record it."""
from __future__ import annotations

import platform
from pathlib import Path


def machine() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (macOS, Windows)
        pass
    return platform.processor() or platform.machine()
