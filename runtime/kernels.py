"""The torch backend's kernels: the function each ``rw`` op lowers to.

By default an op runs its reference (``rewriter.ops.REFERENCE``). The few below are
faster at decode time, where a step is hundreds of calls on one-token tensors and each
extra tensor op costs about a microsecond; each gives bit-identical results to the
reference on the inputs it accepts (float32; bfloat16 products up to summation order) and
falls back to it on the rest (``tests/test_runtime_kernels.py`` checks both). The int4
kernel is the exception: it rounds its scales to bfloat16 (``linear_int4_cpu``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.maths.int4 import GROUP_SIZES, unpack
from rewriter.ops import REFERENCE


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    # The reference normalises in float32 and casts back before the weight (as Llama
    # does); for float32 in and out that is exactly ATen's fused rms_norm.
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not unit_offset:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return REFERENCE["rms_norm"](x, weight, eps, unit_offset)


def rope(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    if cos.shape[-1] != head_dim or cos.dtype != x.dtype:  # partial rotary, mixed dtypes
        return REFERENCE["rope"](x, cos, sin, head_dim)
    b, s, _ = x.shape
    xh = x.view(b, s, -1, head_dim)  # [B, S, H, D]
    x1, x2 = xh.chunk(2, dim=-1)  # [B, S, H, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)
    out = xh * cos[:, :, None] + rotated * sin[:, :, None]  # cos/sin [B, S, 1, D]
    return out.view(b, s, -1)  # [B, S, H*D]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 unit_offset: bool = False) -> tuple[Tensor, Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps, unit_offset), total


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``rw.linear`` on a 2-d view of ``x``: given a 3-d bfloat16 input, ATen's CPU linear
    copies the whole weight first (78 ms for SmolLM2's LM head against 4 ms, measured);
    float32 folds the leading dimensions the same way, so its results are unchanged."""
    if x.dim() == 2:
        return F.linear(x, weight, bias)
    flat = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)  # [tokens, out]
    return flat.view(*x.shape[:-1], flat.shape[-1])


def linear_t(x: Tensor, weight_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``rw.linear`` with the weight stored transposed, ``[in, out]``.

    On a CPU, a one-token step is a vector-matrix product bound by reading the weights;
    CPU BLAS streams a row-major ``[in, out]`` matrix (one axpy per input feature) about
    1.8x faster than ``F.linear``'s ``[out, in]`` (measured on this project's default
    model's shapes). Results equal ``F.linear`` up to float summation order.
    """
    if bias is None:
        return torch.matmul(x, weight_t)
    flat = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight_t)  # [tokens, out]
    return flat.view(*x.shape[:-1], weight_t.shape[1])


def linear_int4_cpu(x: Tensor, packed: Tensor, scale_zeros: Tensor, group_size: int,
                    bias: Tensor | None = None) -> Tensor:
    """``rw.linear_int4`` on torch's CPU int4 kernel, which multiplies the 4-bit codes
    without a dequantized copy: ``packed`` from ``_convert_weight_to_int4pack_for_cpu``,
    ``scale_zeros`` ``[in / g, out, 2]`` (its weight is ``(code - 8) * scale + zero``, so
    ``zero = min + 8 * scale``; see ``int4_cpu_tables``). bfloat16 only: its float32 and
    float16 paths are 20-30x slower than bfloat16 on the machines measured.
    """
    flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
    y = torch._weight_int4pack_mm_for_cpu(flat, packed, group_size, scale_zeros)  # [tokens, out]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def int4_cpu_ok(codes: Tensor, scales: Tensor, group_size: int) -> bool:
    """Whether ``linear_int4_cpu`` takes these weights (the kernel's own limits)."""
    return (not codes.is_cuda and scales.dtype == torch.bfloat16 and codes.shape[0] % 16 == 0
            and group_size in GROUP_SIZES)


def int4_cpu_tables(codes: Tensor, scales: Tensor, mins: Tensor) -> tuple[Tensor, Tensor]:
    """``(packed, scale_zeros)`` for ``linear_int4_cpu`` from ``rw.linear_int4``'s weights."""
    packed = torch._convert_weight_to_int4pack_for_cpu(unpack(codes).to(torch.int32), 1)
    return packed, int4_scale_zeros(scales, mins)


def int4_scale_zeros(scales: Tensor, mins: Tensor) -> Tensor:
    """The CPU int4 kernel's ``[G, out, 2]`` table of ``(scale, zero)`` in ``scales``'
    dtype from ``[out, G]`` scales and minimums: ``zero = min + 8 * scale`` (its codes are
    read as ``code - 8``), computed in float32 and rounded once."""
    zeros = mins.float() + 8 * scales.float()  # [out, G]
    table = torch.stack((scales.float(), zeros), dim=-1).transpose(0, 1)  # [G, out, 2]
    return table.to(scales.dtype).contiguous()


KERNELS = {**REFERENCE, "linear": linear, "rms_norm": rms_norm, "rope": rope, "add_rms_norm": add_rms_norm}
