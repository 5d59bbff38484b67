"""The torch backend's kernels: the function each ``rw`` op lowers to.

By default an op runs its reference (``rewriter.ops.REFERENCE``). The few below are
faster at decode time, where a step is hundreds of calls on one-token tensors and each
extra tensor op costs about a microsecond; each gives bit-identical results to the
reference on the inputs it accepts and falls back to it on the rest
(``tests/test_runtime_kernels.py`` checks both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.ops import REFERENCE


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The reference normalises in float32 and casts back before the weight (as Llama
    # does); for float32 in and out that is exactly ATen's fused rms_norm.
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return REFERENCE["rms_norm"](x, weight, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    if cos.shape[-1] != head_dim or cos.dtype != x.dtype:  # partial rotary, mixed dtypes
        return REFERENCE["rope"](x, cos, sin, head_dim)
    b, s, _ = x.shape
    xh = x.view(b, s, -1, head_dim)  # [B, S, H, D]
    x1, x2 = xh.chunk(2, dim=-1)  # [B, S, H, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)
    out = xh * cos[:, :, None] + rotated * sin[:, :, None]  # cos/sin [B, S, 1, D]
    return out.view(b, s, -1)  # [B, S, H*D]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return rms_norm(total, weight, eps), total


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


KERNELS = {**REFERENCE, "rms_norm": rms_norm, "rope": rope, "add_rms_norm": add_rms_norm}
