"""RMSNorm, and the residual add fused with it (``rw.rms_norm``, ``rw.add_rms_norm``).

Reference (``rewriter.ops``): ``total = x + residual``; ``h = total.float()``;
``out = weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)``, or with ``unit_offset``
(Gemma) ``out = ((1 + weight) * h * rsqrt(mean(h^2) + eps)).to(x.dtype)``. Bytes moved per row of H:
x, residual and weight read once, out and total written once: (4 H + H) * itemsize.
One program per row; the row is one block (H up to a few thousand: one read, in registers).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import check, row_warps


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, total_ptr, n_cols, x_stride, res_stride,
                        out_stride, total_stride, eps, HAS_RESIDUAL: tl.constexpr,
                        UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the sum, rounded as torch does
        tl.store(total_ptr + row * total_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: (1 + w) times the float32 row, then the cast
        y = (h * inv) * (1.0 + w.to(tl.float32))
    else:  # Llama: the row cast back first, then the weight
        y = w.to(tl.float32) * (h * inv).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float, unit_offset: bool = False, out: Optional[torch.Tensor] = None,
                 total: Optional[torch.Tensor] = None):
    """``(rms_norm(x + residual), x + residual)``; with ``residual=None``, ``rms_norm(x)``.
    ``out``/``total`` (contiguous, shaped like ``x``) receive the results when given."""
    shape, n = x.shape, x.shape[-1]
    check(tuple(weight.shape) == (n,), "add_rms_norm", f"weight {list(weight.shape)} for rows of {n}")
    check(residual is None or residual.shape == shape, "add_rms_norm",
          f"residual {list(residual.shape) if residual is not None else None} != x {list(shape)}")
    for name, t in (("out", out), ("total", total)):
        check(t is None or (t.shape == shape and t.is_contiguous()), "add_rms_norm",
              f"{name} must be contiguous and shaped like x {list(shape)}")
    x2 = x.reshape(-1, n)  # [rows, H]
    if out is None:
        dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
        out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if total is None:
        total = torch.empty_like(x2) if residual is not None else out
    out, total = out.view(-1, n), total.view(-1, n)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    block = triton.next_power_of_2(n)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        x2, r2 = x2.contiguous(), r2.contiguous()
    add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, total, n, x2.stride(0), r2.stride(0), out.stride(0), total.stride(0),
        eps, HAS_RESIDUAL=residual is not None, UNIT_OFFSET=bool(unit_offset), BLOCK=block,
        num_warps=row_warps(block))
    if residual is None:
        return out.view(shape)
    return out.view(shape), total.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps, unit_offset, out=out)
