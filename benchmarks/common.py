"""What the benchmarks share: the model they load, the machine they describe, how they time
and where they write.

Every benchmark records the machine, its thread count, torch's version and the date beside
its figures (``describe``), so a figure copied into ``docs/benchmarks.md`` says where it
was measured. The scripts run as ``python benchmarks/NAME.py``, so this module is imported
as ``common`` (the script's folder is on ``sys.path``).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def load(name: str):
    """(model, tokenizer) of ``smollm2`` (its GGUF file), ``default`` or a checkpoint path,
    in float32, as the quickstart loads them."""
    from rewriter.models.checkpoints import load_model
    return load_model(name)


def machine(device: str = "cpu") -> str:
    """The GPU's name on ``cuda``, else the CPU's model name."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    from rewriter.measure.machine import machine as cpu_name
    return cpu_name()


def describe(device: str = "cpu") -> dict:
    """The record's header: where and when the figures were measured."""
    return {"machine": machine(device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def sync() -> None:
    """Waits for queued GPU work, so a timer stops when the work is done, not queued."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_all(fn, repeat: int):
    """(the last run's result, every timed run's seconds) after one warm-up run, which
    allocates caches, fills allocator pools and compiles."""
    out = fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return out, times


def median_of(fn, repeat: int) -> tuple[float, object]:
    """(median seconds, the last run's result) of ``timed_all``."""
    out, times = timed_all(fn, repeat)
    return statistics.median(times), out


def write_json(path: str | Path, record: dict) -> None:
    """Writes ``record`` to ``path``, making its folder; values JSON cannot hold (dtypes,
    paths) are written as their text."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")
