"""How far the bfloat16 int4 path's weights are from SmolLM2's Q4_1 file, and why.

    python benchmarks/int4_scales.py [--json benchmarks/results/int4_scales.json]

Reads every Q4_1 matrix of the GGUF file (its codes, float16 steps ``d`` and minimums
``m``: ``w = code * d + m``) and rebuilds the table torch's CPU int4 kernel multiplies with,
``w = (code - 8) * scale + zero`` in bfloat16, two ways:

- ``as lowered``: what ``Int4Weights`` and the lowering do for a bfloat16 model: the
  bfloat16 weights quantized (scales and minimums stored in bfloat16), then the kernel's
  ``zero = min + 8 * scale`` made from those and rounded to bfloat16 again;
- ``float32 IR``: quantized from the float32 weights, before the cast, scales and minimums
  kept in float32, the kernel's scale and zero each rounded to bfloat16 once.

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
from rewriter.int4 import quantize, unpack
from rewriter.runtime.kernels import int4_scale_zeros

BLOCK = 20  # bytes of a Q4_1 block: float16 d, float16 m, 16 bytes of 32 codes


def q4_1_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [blocks, 32] float32, d [blocks], m [blocks])`` of one Q4_1 tensor."""
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, BLOCK)  # [blocks, 20]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    qs = raw[:, 4:]  # low nibbles are values 0..15 of the block, high nibbles 16..31
    codes = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


def tables(weight: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For the file's weights ``[blocks, 32]`` (one group a row), each way's ``(codes,
    scale, zero)``, ``[blocks, 32]`` and ``[blocks]``, as the kernel reads them back."""
    ways = {}
    # as lowered: Int4Weights quantizes the bfloat16 model's weights (scales and mins in
    # bfloat16), the lowering builds the kernel's table from those
    codes, scales, mins = quantize(weight.to(torch.bfloat16), 32)
    ways["as lowered"] = (codes, int4_scale_zeros(scales, mins))
    # float32 IR: quantized before the cast, scales and mins kept in float32, the table
    # rounded to bfloat16 once
    codes, scales, mins = quantize(weight, 32)
    ways["float32 IR"] = (codes, int4_scale_zeros(scales, mins).to(torch.bfloat16))
    return {way: (unpack(c).float(), t[0, :, 0].float(), t[0, :, 1].float())  # t: [1, blocks, 2]
            for way, (c, t) in ways.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/int4_scales.json")
    args = ap.parse_args()
    import gguf
    reader = gguf.GGUFReader(str(smollm2_file()))
    worst, squares, changed, count, matrices = {}, {}, {}, 0, 0
    minimums = []
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        codes, d, m = q4_1_blocks(tensor)
        weight = codes * d[:, None] + m[:, None]  # [blocks, 32], the file's own
        for way, (code, scale, zero) in tables(weight).items():
            error = (code - 8) * scale[:, None] + zero[:, None] - weight
            changed[way] = changed.get(way, 0) + int((code != codes).sum())
            worst[way] = max(worst.get(way, 0.0), error.abs().max().item())
            squares[way] = squares.get(way, 0.0) + float(error.double().pow(2).sum())
        minimums.append(m.abs())
        count, matrices = count + weight.numel(), matrices + 1
    lows = torch.cat(minimums)
    rows = [[way, changed[way], f"{worst[way]:.4f}", f"{(squares[way] / count) ** 0.5:.5f}"]
            for way in worst]
    print(f"{matrices} Q4_1 matrices, {count} weights; |minimum| max {lows.max().item():.2f}, "
          f"{int((lows > 3).sum())} groups above 3")
    print(tabulate(rows, headers=["tables", "codes unlike the file's", "max error", "RMS error"]))
    out = {"matrices": matrices, "weights": count, "max_abs_minimum": lows.max().item(),
           "groups_minimum_above_3": int((lows > 3).sum()),
           "ways": {way: {"codes_changed": changed[way], "max": worst[way],
                          "rms": (squares[way] / count) ** 0.5} for way in worst}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
