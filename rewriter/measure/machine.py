"""The machine a measurement ran on, as timings, training reports and benchmarks record it."""
from __future__ import annotations

import platform
from pathlib import Path

import torch


def machine() -> str:
    """The CPU's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (macOS, Windows)
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    """The GPU's name for a CUDA ``device``, else the CPU's (``machine``)."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else machine()


def timed_backend(backend: str, device) -> str:
    """The backend whose kernels time a model that runs ``backend`` on ``device``: Triton on
    a CPU runs in its interpreter, whose costs match no real engine, so the torch kernels
    are timed there (and an artifact measured so is not "measured elsewhere")."""
    return backend if torch.device(device).type == "cuda" else "torch"
