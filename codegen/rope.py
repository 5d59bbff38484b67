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
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, head_dim, half, x_stride,
                cs_stride, out_stride, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    base = x_ptr + token * x_stride + head * head_dim
    dst = out_ptr + token * out_stride + head * head_dim
    i = tl.arange(0, BLOCK_HALF)
    m = i < half
    a1 = tl.load(base + i, mask=m, other=0.0).to(tl.float32)
    a2 = tl.load(base + half + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + i, (a1 * c1 - a2 * s1).to(ty), mask=m)
    tl.store(dst + half + i, (a2 * c2 + a1 * s2).to(ty), mask=m)
    j = 2 * half + tl.arange(0, BLOCK_D)  # features past the rotary part pass through
    mp = j < head_dim
    tl.store(dst + j, tl.load(base + j, mask=mp, other=0.0), mask=mp)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
         out: torch.Tensor | None = None) -> torch.Tensor:
    b, s, hd = x.shape
    heads, rot = hd // head_dim, cos.shape[-1]
    x2 = x.reshape(b * s, hd)  # [tokens, H*D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    c2 = cos.to(x.dtype).reshape(b * s, rot).contiguous()  # the reference casts cos/sin first
    s2 = sin.to(x.dtype).reshape(b * s, rot).contiguous()
    out = torch.empty_like(x2) if out is None else out.view(b * s, hd)
    rope_kernel[(b * s, heads)](x2, c2, s2, out, heads, head_dim, rot // 2, x2.stride(0),
                                c2.stride(0), out.stride(0),
                                BLOCK_HALF=triton.next_power_of_2(max(1, rot // 2)),
                                BLOCK_D=triton.next_power_of_2(max(1, head_dim - rot)))
    return out.view(b, s, hd)


@triton.jit
def rope_into_cache_kernel(k_ptr, cos_ptr, sin_ptr, cache_ptr, seq, start, head_dim, half,
                           k_stride, cs_stride, c_sb, c_sh, c_sl,
                           BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)  # b * seq + s
    head = tl.program_id(1)
    b, s = token // seq, token % seq
    src = k_ptr + token * k_stride + head * head_dim
    dst = cache_ptr + b * c_sb + head * c_sh + (start + s) * c_sl
    i = tl.arange(0, BLOCK_HALF)
    m = i < half
    a1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    a2 = tl.load(src + half + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * cs_stride + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * cs_stride + half + i, mask=m, other=0.0).to(tl.float32)
    ty = cache_ptr.dtype.element_ty
    tl.store(dst + i, (a1 * c1 - a2 * s1).to(ty), mask=m)
    tl.store(dst + half + i, (a2 * c2 + a1 * s2).to(ty), mask=m)
    j = 2 * half + tl.arange(0, BLOCK_D)
    mp = j < head_dim
    tl.store(dst + j, tl.load(src + j, mask=mp, other=0.0), mask=mp)


def rope_into_cache(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    cache: torch.Tensor, start: int) -> None:
    """Rotate ``k`` ``[B, S, Hkv*D]`` and write it into ``cache`` ``[B, Hkv, L, D]`` at
    positions ``[start, start + S)``: ``FuseRoPE``'s K path, one read and one write."""
    b, s, hd = k.shape
    heads, rot = hd // head_dim, cos.shape[-1]
    k2 = k.reshape(b * s, hd)
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    c2 = cos.to(k.dtype).reshape(b * s, rot).contiguous()
    s2 = sin.to(k.dtype).reshape(b * s, rot).contiguous()
    rope_into_cache_kernel[(b * s, heads)](
        k2, c2, s2, cache, s, start, head_dim, rot // 2, k2.stride(0), c2.stride(0),
        *cache.stride()[:3], BLOCK_HALF=triton.next_power_of_2(max(1, rot // 2)),
        BLOCK_D=triton.next_power_of_2(max(1, head_dim - rot)))
