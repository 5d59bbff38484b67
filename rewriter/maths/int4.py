"""4-bit weights: group-wise min/max quantization and the byte layout of ``rw.linear_int4``.

A weight ``[out, in]`` is cut along ``in`` into groups of ``g`` values. Each group keeps its
minimum ``m`` and step ``s = (max - m) / 15``; each value becomes ``code = round((w - m) / s)``
in 0..15 and reads back as ``code * s + m``. Codes are packed two per byte, column ``2j`` in
the low nibble: ``codes`` is ``uint8 [out, in / 2]``, ``scales`` and ``mins`` ``[out, in / g]``.

This is GGUF's Q4_1 format with its blocks of 32 (llama.cpp stores ``d = s`` and ``m``). A
weight that some 4-bit format already put on a grid per group of 32 (Q4_0, Q4_1, Q4_K) is
held exactly: ``quantize`` finds, for each group, a step and minimum that read every value
back to the last bit (in float32), trying the grids that span the group's own range in 15
steps (Q4_1 always uses codes 0 and 15), then in 14, ... 1 (a Q4_K group's codes need not
reach 0 or 15); every candidate is checked against the weight, so a group is exact or
rounded as min/max quantization rounds it, never wrongly called exact.

Q4_K reads ``w = d * sc * q - dmin * m``, in float32: ``s = d * sc`` and ``dmin * m`` (an
fp16 times 6 bits: 17 significant bits) are float32 numbers. The minimum held is the
group's smallest value and the codes are the file's less the smallest one used, so
``code * s + min`` rounds once, as ``gguf``'s ``s * q - dmin * m`` does. Where the file's
largest value in a group rounded (``dmin`` far below ``d``), the span gives the step a
little off; it is snapped to 17 significant bits, which ``s`` has. What can still miss: a
group whose smallest value itself rounded (not met in a real Q4_K_M file's 737,280 groups,
nor in ``tests/test_kquant.py``'s random blocks; it would be counted inexact). Scales are
held in the weight's dtype: float32 holds ``d * sc`` exactly; a bfloat16 model's weights
are already the file's values rounded to bfloat16, and its scales round too (to 8 bits).
"""
from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZES = (32, 64, 128, 256)  # the CPU kernel's (torch._weight_int4pack_mm_for_cpu)
DEFAULT_GROUP = 32  # Int4Weights' default, and the int4 draft's of self-speculation
# significant bits of a K-quant group's step d * sc: an fp16 d (11) times a 6-bit sc
STEP_BITS = 17


ROWS_AT_ONCE = 1 << 22  # weights quantized this many values at a time: bounded scratch


def quantize(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(codes, scales, mins)`` of a 2-d float ``weight`` ``[out, in]``; scales and mins
    in the weight's dtype, computed in float32. Groups already on a 4-bit grid come back
    exact (the module's docstring); the others get the min/max grid of 15 steps. Done in
    blocks of rows, so the search's float32 copies and sort stay small for an LM head."""
    rows = max(1, ROWS_AT_ONCE // weight.shape[1])
    parts = [_quantize(block, group_size) for block in weight.split(rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _quantize(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    out, width = weight.shape
    w = weight.detach().to(torch.float32).view(out, width // group_size, group_size)  # [out, G, g]
    # the minimum as it will be stored (rounded to the weight's dtype), so the codes are
    # chosen against the values that will read them back
    low = w.amin(dim=-1, keepdim=True).to(weight.dtype).float()  # [out, G, 1]
    span = w.amax(dim=-1, keepdim=True) - low
    code, step = _grid(w, low, span, 15, weight.dtype)
    if weight.dtype == torch.float32:  # a file's values rounded to 8 bits sit on no grid
        _exact_grids(w, low, span, code, step, weight.dtype)
    code = code.view(out, width)
    codes = code[:, 0::2] | (code[:, 1::2] << 4)  # [out, in / 2]
    scales, mins = (t.squeeze(-1).to(weight.dtype) for t in (step, low))  # [out, G] each
    return codes.contiguous(), scales.contiguous(), mins.contiguous()


def _grid(w: Tensor, low: Tensor, span: Tensor, steps: int, dtype,
          snap: bool = False) -> tuple[Tensor, Tensor]:
    """Codes ``uint8 [.., g]`` and step ``[.., 1]`` (float32 holding a ``dtype`` number) of
    the grid from ``low`` in ``steps`` steps over ``span``; with ``snap``, the step rounded
    to ``STEP_BITS`` significant bits."""
    step = (span / steps).to(dtype).float()
    if snap:  # float32 bits: keep the sign, exponent and top STEP_BITS - 1 stored mantissa bits
        drop = 24 - STEP_BITS
        bits = step.view(torch.int32)
        step = ((bits + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32).to(dtype).float()
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 0
    return torch.round((w - low) / safe).clamp_(0, 15).to(torch.uint8), step


def _exact_grids(w: Tensor, low: Tensor, span: Tensor, code: Tensor, step: Tensor, dtype) -> None:
    """Replace, in place, the code and step of each group of ``w`` ``[out, G, g]`` that the
    15-step grid misses but another grid from the same minimum reads back exactly: fewer
    steps (a Q4_K group's codes need not reach 15), or the step snapped to the bits a
    K-quant step has (the group's largest value rounded, so its span is a little off).
    Only groups of at most 16 distinct values can be on one (a cheap sort rules out the
    rest: a weight that was never 4-bit costs one pass)."""
    todo = ~_reads_back(w, low, code, step)  # [out, G]
    if not todo.any():  # every group on the 15-step grid (a Q4_0/Q4_1 file): done
        return
    ranked = w[todo].sort(dim=-1).values  # [n, g]
    todo[todo.clone()] = 1 + (ranked[:, 1:] != ranked[:, :-1]).sum(dim=-1) <= 16
    for steps, snap in ((n, snap) for n in range(15, 0, -1) for snap in (False, True)):
        if not todo.any():
            return
        if steps == 15 and not snap:
            continue  # the grid tried first
        sub_w, sub_low = w[todo], low[todo]  # [n, g], [n, 1]
        c, s = _grid(sub_w, sub_low, span[todo], steps, dtype, snap)
        hit = _reads_back(sub_w, sub_low, c, s)  # [n]
        where = todo.nonzero()[hit].unbind(dim=1)
        code[where], step[where] = c[hit], s[hit]
        todo[where] = False


def _reads_back(w: Tensor, low: Tensor, code: Tensor, step: Tensor) -> Tensor:
    """Per group, whether ``code * step + low`` (the reference op's arithmetic) is ``w``."""
    return ((code.float() * step + low) == w).all(dim=-1)


def unpack(codes: Tensor) -> Tensor:
    """The codes ``uint8 [out, in]`` (0..15) of packed ``codes`` ``[out, in / 2]``."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).view(codes.shape[0], -1)


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor, group_size: int) -> Tensor:
    """The float32 weight ``[out, in]`` that ``codes``, ``scales`` and ``mins`` stand for."""
    code = unpack(codes).to(torch.float32)
    out, width = code.shape
    groups = code.view(out, width // group_size, group_size)  # [out, G, g]
    return (groups * scales.float()[..., None] + mins.float()[..., None]).view(out, width)
