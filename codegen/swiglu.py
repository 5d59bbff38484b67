"""``silu(gate) * up`` over ``gate_up = [gate | up]`` (``rw.swiglu``).

Reference: ``gate, up = gate_up.chunk(2, -1); F.silu(gate) * up``. Bytes per row of 2F:
2F read, F written. One program per (row, block of F columns).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check


@triton.jit
def swiglu_kernel(gu_ptr, out_ptr, n_cols, gu_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype)  # F.silu rounds to the input dtype first
    # The product of two bf16/fp16 values is exact in fp32, so one rounding gives torch's
    # result (and the interpreter cannot multiply bf16 directly).
    y = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    two_f = gate_up.shape[-1]
    n = two_f // 2
    check(two_f % 2 == 0, "swiglu", f"gate_up's last dim {two_f} is not [gate | up]")
    check(out is None or (out.numel() == gate_up.numel() // 2 and out.is_contiguous()), "swiglu",
          f"out must be contiguous with {gate_up.numel() // 2} elements")
    gu = gate_up.reshape(-1, two_f)  # [rows, 2F]
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    if out is None:
        out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    out = out.view(gu.shape[0], n)
    block = min(1024, triton.next_power_of_2(n))
    swiglu_kernel[(gu.shape[0], triton.cdiv(n, block))](gu, out, n, gu.stride(0), out.stride(0),
                                                        BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)
