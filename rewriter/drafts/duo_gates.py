"""DuoAttention's gates file: one gate in [0, 1] per layer and KV head, and the sink + window
cache they were calibrated for (``rewriter.training.train_gates`` writes it, ``DuoAttention(gates=
PATH)`` reads it).

The file is JSON, read with a size limit and every field checked: a gates file may come
from someone else, and a wrong one would split the wrong heads without a word.

    {"format": "rewriter-duo-gates", "version": 1, "sinks": 16, "window": 64,
     "positions": "cache",                              # the sinks' positions (StreamingLLM's)
     "gates": [[0.97, 0.02], ...],                      # [layers][kv_heads]
     "model": {"layers": 8, "num_kv_heads": 2, "head_dim": 32},
     "calibration": {...}}                              # how they were made (free-form)
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from rewriter.files import safe_files
from rewriter.values import MAX_INT, parse_json

FORMAT, VERSION = "rewriter-duo-gates", 1
MAX_BYTES = 4 << 20  # a 1000-layer, 64-head model's gates are ~1 MB of JSON
ASSETS = Path(__file__).parent.parent / "assets" / "gates"
SHIPPED = ("default", "smollm2")  # calibrated gates shipped for the shipped models


class GatesFileError(ValueError):
    """A gates file that cannot be used: the message names the file and the problem."""


@dataclass
class Gates:
    gates: list  # [layers][kv_heads] floats in [0, 1]
    sinks: int
    window: int
    model: dict = field(default_factory=dict)  # layers, num_kv_heads, head_dim
    calibration: dict = field(default_factory=dict)
    positions: str = "cache"  # the streaming heads' sinks: StreamingLLM's, or "original"

    def to_json(self) -> str:
        """Indented JSON with one line per layer's gates."""
        rows = ",\n  ".join(json.dumps(r) for r in self.gates)
        head = {"format": FORMAT, "version": VERSION, "sinks": self.sinks, "window": self.window,
                "positions": self.positions}
        tail = {"model": self.model, "calibration": self.calibration}
        return (json.dumps(head, indent=1)[:-2] + f',\n "gates": [\n  {rows}\n ],\n'
                + json.dumps(tail, indent=1)[2:])


def resolve(gates: Union[str, os.PathLike]) -> Path:
    """A gates file's path: a shipped name (``default``, ``smollm2``) or a path."""
    if isinstance(gates, str) and gates in SHIPPED:
        return ASSETS / f"{gates}.json"
    return Path(gates)


def load(gates: Union[str, os.PathLike]) -> Gates:
    path = resolve(gates)
    if not path.is_file():
        raise GatesFileError(f"{path}: no such gates file")
    with open(path, "rb") as f:
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise GatesFileError(f"{path}: larger than {MAX_BYTES} bytes, the most a gates file holds")
    try:
        data = parse_json(raw)
    except ValueError as e:  # not JSON, or nested past any gates file
        raise GatesFileError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or type(data.get("version")) is not int or data["version"] != VERSION:
        raise GatesFileError(f"{path}: not a {FORMAT} file of version {VERSION}")
    why = check_gates(data.get("gates")) or _check_int(data, "sinks", 0) or _check_int(data, "window", 1)
    if not why and data.get("positions", "cache") not in ("cache", "original"):
        why = f"positions must be 'cache' or 'original', got {data.get('positions')!r}"
    for key in ("model", "calibration"):
        if not why and not isinstance(data.get(key, {}), dict):
            why = f"{key} must be an object"
    if why:
        raise GatesFileError(f"{path}: {why}")
    return Gates(data["gates"], data["sinks"], data["window"], data.get("model", {}),
                 data.get("calibration", {}), data.get("positions", "cache"))


def save(gates: Gates, path: Union[str, os.PathLike]) -> None:
    why = check_gates(gates.gates)
    if why:
        raise ValueError(f"gates: {why}")
    # a fresh temporary file beside it (O_EXCL: never one planted there), then renamed over;
    # an error (a full disk) names the path and leaves the old file
    safe_files.replace_path(path, gates.to_json().encode())


def check_gates(gates) -> str | None:
    """Why ``gates`` is not ``[layers][kv_heads]`` numbers in [0, 1], or None."""
    if not isinstance(gates, list) or not gates or not all(isinstance(r, list) and r for r in gates):
        return "gates must be a non-empty list of per-layer lists (one gate per KV head)"
    if len({len(r) for r in gates}) != 1:
        return f"gates must give every layer the same number of KV heads, got {[len(r) for r in gates]}"
    for i, row in enumerate(gates):
        for h, g in enumerate(row):
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                    or not 0 <= g <= 1:
                return f"gate [{i}][{h}] must be a number in [0, 1], got {g!r}"
    return None


def _check_int(data: dict, key: str, low: int) -> str | None:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= MAX_INT:
        return f"{key} must be an integer in [{low}, {MAX_INT}], got {v!r}"
    return None
