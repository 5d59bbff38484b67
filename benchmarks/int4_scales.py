"""How far the bfloat16 int4 path's weights are from SmolLM2's Q4_1 file, and why.

    python benchmarks/int4_scales.py [--json benchmarks/results/int4_scales.json]

Reads every Q4_1 matrix of the GGUF file (its codes, float16 steps ``d`` and minimums
``m``: ``w = code * d + m``) and rebuilds the table torch's CPU int4 kernel multiplies with,
``w = (code - 8) * scale + zero`` in bfloat16, two ways:

- ``as lowered``: the scales and minimums rounded to bfloat16 (as ``Int4Weights`` stores
  them in a bfloat16 IR), then ``zero = min + 8 * scale`` from those, rounded again;
- ``float32 IR``: the scale and ``zero`` computed from the file's values, each rounded once.

Prints the max and RMS error against the file's weights, and the minimums' magnitude (a
large minimum loses the most to bfloat16's 8-bit mantissa). No model is run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from tabulate import tabulate

from rewriter.gguf import smollm2_file

BLOCK = 20  # bytes of a Q4_1 block: float16 d, float16 m, 16 bytes of 32 codes


def q4_1_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [blocks, 32] float32, d [blocks], m [blocks])`` of one Q4_1 tensor."""
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, BLOCK)  # [blocks, 20]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    qs = raw[:, 4:]  # low nibbles are values 0..15 of the block, high nibbles 16..31
    codes = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def tables(d: torch.Tensor, m: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The kernel's ``(scale, zero)`` per block, as read back in float32, for each way."""
    bf = torch.bfloat16
    scale, low = d.to(bf).float(), m.to(bf).float()
    return {"as lowered": (scale, (low + 8 * scale).to(bf).float()),
            "float32 IR": (scale, (m + 8 * d).to(bf).float())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/int4_scales.json")
    args = ap.parse_args()
    import gguf
    reader = gguf.GGUFReader(str(smollm2_file()))
    worst, squares, count, matrices = {}, {}, 0, 0
    minimums = []
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        codes, d, m = q4_1_blocks(tensor)
        weight = codes * d[:, None] + m[:, None]  # [blocks, 32], the file's own
        for way, (scale, zero) in tables(d, m).items():
            error = (codes - 8) * scale[:, None] + zero[:, None] - weight
            worst[way] = max(worst.get(way, 0.0), error.abs().max().item())
            squares[way] = squares.get(way, 0.0) + float(error.double().pow(2).sum())
        minimums.append(m.abs())
        count, matrices = count + weight.numel(), matrices + 1
    lows = torch.cat(minimums)
    rows = [[way, f"{worst[way]:.4f}", f"{(squares[way] / count) ** 0.5:.5f}"] for way in worst]
    print(f"{matrices} Q4_1 matrices, {count} weights; |minimum| max {lows.max().item():.2f}, "
          f"{int((lows > 3).sum())} groups above 3")
    print(tabulate(rows, headers=["tables", "max error", "RMS error"]))
    out = {"matrices": matrices, "weights": count, "max_abs_minimum": lows.max().item(),
           "groups_minimum_above_3": int((lows > 3).sum()),
           "ways": {way: {"max": worst[way], "rms": (squares[way] / count) ** 0.5} for way in worst}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
