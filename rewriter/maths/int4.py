"""4-bit weights: group-wise min/max quantization and the byte layout of ``rw.linear_int4``.

A weight ``[out, in]`` is cut along ``in`` into groups of ``g`` values. Each group keeps its
minimum ``m`` and step ``s = (max - m) / 15``; each value becomes ``code = round((w - m) / s)``
in 0..15 and reads back as ``code * s + m``. Codes are packed two per byte, column ``2j`` in
the low nibble: ``codes`` is ``uint8 [out, in / 2]``, ``scales`` and ``mins`` ``[out, in / g]``.

This is GGUF's Q4_1 format with its blocks of 32 (llama.cpp stores ``d = s`` and ``m``): a
Q4_1 group always uses codes 0 and 15 (its minimum and maximum), so a model dequantized from
Q4_1 is re-quantized here to exactly its own codes, and the reference op reproduces its
weights to the last bit in float32 (``tests/test_int4.py`` checks SmolLM2's).
"""
from __future__ import annotations

import torch
from torch import Tensor

GROUP_SIZES = (32, 64, 128, 256)  # the CPU kernel's (torch._weight_int4pack_mm_for_cpu)
DEFAULT_GROUP = 32  # Int4Weights' default, and the int4 draft's of self-speculation


def quantize(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(codes, scales, mins)`` of a 2-d float ``weight`` ``[out, in]``; scales and mins
    in the weight's dtype, computed in float32."""
    out, width = weight.shape
    w = weight.detach().to(torch.float32).view(out, width // group_size, group_size)  # [out, G, g]
    # the step and minimum as they will be stored (rounded to the weight's dtype), so the
    # codes are chosen against the values that will read them back
    low = w.amin(dim=-1, keepdim=True).to(weight.dtype).float()
    step = ((w.amax(dim=-1, keepdim=True) - low) / 15).to(weight.dtype).float()
    safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 0
    code = torch.round((w - low) / safe).clamp_(0, 15).to(torch.uint8).view(out, width)
    codes = code[:, 0::2] | (code[:, 1::2] << 4)  # [out, in / 2]
    scales, mins = (t.squeeze(-1).to(weight.dtype) for t in (step, low))  # [out, G] each
    return codes.contiguous(), scales.contiguous(), mins.contiguous()


def unpack(codes: Tensor) -> Tensor:
    """The codes ``uint8 [out, in]`` (0..15) of packed ``codes`` ``[out, in / 2]``."""
    return torch.stack((codes & 15, codes >> 4), dim=-1).view(codes.shape[0], -1)


def dequantize(codes: Tensor, scales: Tensor, mins: Tensor, group_size: int) -> Tensor:
    """The float32 weight ``[out, in]`` that ``codes``, ``scales`` and ``mins`` stand for."""
    code = unpack(codes).to(torch.float32)
    out, width = code.shape
    groups = code.view(out, width // group_size, group_size)  # [out, G, g]
    return (groups * scales.float()[..., None] + mins.float()[..., None]).view(out, width)
