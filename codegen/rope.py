"""Rotary embedding over heads folded in the last dim (``rw.rope``).

Reference: for each head of ``x`` ``[B, S, H*D]``, the first ``R = cos.shape[-1]`` features
are rotated: ``x[:R] * cos + rotate_half(x[:R]) * sin`` with ``rotate_half(a) = [-a2, a1]``;
the other ``D - R`` pass through. Bytes per token: H*D read and written, 2R of cos/sin.
One program per (token, head).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, start_ptr, seq, start, head_dim, half,
                x_stride, cs_stride, o_sb, o_ss, o_sh, START_FROM_PTR: tl.constexpr,
                BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (token, head): read ``x`` ``[tokens, H*D]``, write the rotated head at
    ``out + b*o_sb + (start + s)*o_ss + head*o_sh``: a ``[B, S, H*D]`` tensor or a
    ``[B, H, L, D]`` cache, by strides. ``start`` may come from a device value."""
    if START_FROM_PTR:
        start = tl.load(start_ptr)
    token = tl.program_id(0)  # b * seq + s
    head = tl.program_id(1)
    b, s = token // seq, token % seq
    src = x_ptr + token * x_stride + head * head_dim
    dst = out_ptr + b * o_sb + (start + s) * o_ss + head * o_sh
    i = tl.arange(0, BLOCK_HALF)
    m = i < half
    a1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    a2 = tl.load(src + half + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + i, (a1 * c1 - a2 * s1).to(ty), mask=m)
    tl.store(dst + half + i, (a2 * c2 + a1 * s2).to(ty), mask=m)
    j = 2 * half + tl.arange(0, BLOCK_D)  # features past the rotary part pass through
    mp = j < head_dim
    tl.store(dst + j, tl.load(src + j, mask=mp, other=0.0), mask=mp)


def _launch(x, cos, sin, head_dim, out, start, out_strides):
    b, s, hd = x.shape
    heads, rot = hd // head_dim, cos.shape[-1]
    x2 = x.reshape(b * s, hd)  # [tokens, H*D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    c2 = cos.to(x.dtype).reshape(b * s, rot).contiguous()  # the reference casts cos/sin first
    s2 = sin.to(x.dtype).reshape(b * s, rot).contiguous()
    start_ptr = start if isinstance(start, torch.Tensor) else c2  # unused unless a tensor
    rope_kernel[(b * s, heads)](x2, c2, s2, out, start_ptr,
                                s, 0 if isinstance(start, torch.Tensor) else start, head_dim,
                                rot // 2, x2.stride(0), c2.stride(0), *out_strides,
                                START_FROM_PTR=isinstance(start, torch.Tensor),
                                BLOCK_HALF=triton.next_power_of_2(max(1, rot // 2)),
                                BLOCK_D=triton.next_power_of_2(max(1, head_dim - rot)))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``rw.rope``: ``x`` ``[B, S, H*D]`` -> rotated, same shape."""
    b, s, hd = x.shape
    out = torch.empty(b, s, hd, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, cos, sin, head_dim, out, 0, (out.stride(0), out.stride(1), head_dim))
    return out


def rope_into_cache(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    cache: torch.Tensor, start: int | torch.Tensor) -> None:
    """Rotate ``k`` ``[B, S, Hkv*D]`` and write it into ``cache`` ``[B, Hkv, L, D]`` at
    positions ``[start, start + S)``: ``FuseRoPE``'s K path, one read and one write.
    ``start`` may be a one-element device tensor (a CUDA-graph decode step)."""
    _launch(k, cos, sin, head_dim, cache, start, (cache.stride(0), cache.stride(2), cache.stride(1)))
