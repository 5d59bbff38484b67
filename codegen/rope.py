"""Rotary embedding over heads folded in the last dim (``rw.rope``).

Reference: for each head of ``x`` ``[B, S, H*D]``, the first ``R = cos.shape[-1]`` features
are rotated: ``x[:R] * cos + rotate_half(x[:R]) * sin`` with ``rotate_half(a) = [-a2, a1]``;
the other ``D - R`` pass through. Bytes per token: H*D read and written, 2R of cos/sin.
One program per (token, block of heads).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, start_ptr, v_ptr, v_out_ptr, seq, start, heads,
                head_dim, half, x_stride, cs_stride, o_sb, o_ss, o_sh, v_stride, vo_sb, vo_ss,
                vo_sh, start_sb, START_FROM_PTR: tl.constexpr, HAS_V: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HD: tl.constexpr):
    """One token, ``BLOCK_H`` heads: read ``x`` ``[tokens, H*D]``, write each rotated head
    at ``out + b*o_sb + (start + s)*o_ss + head*o_sh``: a ``[B, S, H*D]`` tensor or a
    ``[B, H, L, D]`` cache, by strides. ``start`` may come from a device value, one for
    every row (``start_sb`` 0) or each row's own (``start_sb`` 1). With
    ``HAS_V`` the same heads of ``v`` are copied, unrotated, into the V cache too."""
    token = tl.program_id(0)  # b * seq + s
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    b, s = token // seq, token % seq
    if START_FROM_PTR:
        start = tl.load(start_ptr + b * start_sb)
    src = x_ptr + token * x_stride + h[:, None] * head_dim  # [H, 1]
    dst = out_ptr + b * o_sb + (start + s) * o_ss + h[:, None] * o_sh
    i = tl.arange(0, BLOCK_HALF)
    im = i < half
    m = (h < heads)[:, None] & im[None, :]  # [H, HALF]
    # cos/sin are one row per token, shared by its heads: loaded once, broadcast. They come
    # as computed (fp32) and are rounded to x's dtype here, as rw.rope does first: a cast
    # in the wrapper would be two more launches a layer.
    xt = x_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + token * cs_stride + i, mask=im, other=0.0).to(xt).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + token * cs_stride + half + i, mask=im, other=0.0).to(xt).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + token * cs_stride + i, mask=im, other=0.0).to(xt).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + token * cs_stride + half + i, mask=im, other=0.0).to(xt).to(tl.float32)[None, :]
    a1 = tl.load(src + i[None, :], mask=m, other=0.0).to(tl.float32)
    a2 = tl.load(src + half + i[None, :], mask=m, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(dst + i[None, :], (a1 * c1 - a2 * s1).to(ty), mask=m)
    tl.store(dst + half + i[None, :], (a2 * c2 + a1 * s2).to(ty), mask=m)
    j = 2 * half + tl.arange(0, BLOCK_D)  # features past the rotary part pass through
    mp = (h < heads)[:, None] & (j < head_dim)[None, :]
    tl.store(dst + j[None, :], tl.load(src + j[None, :], mask=mp, other=0.0), mask=mp)
    if HAS_V:  # one launch writes the step's K and V, not two
        e = tl.arange(0, BLOCK_HD)
        mv = (h < heads)[:, None] & (e < head_dim)[None, :]
        vals = tl.load(v_ptr + token * v_stride + h[:, None] * head_dim + e[None, :], mask=mv,
                       other=0.0)
        tl.store(v_out_ptr + b * vo_sb + (start + s) * vo_ss + h[:, None] * vo_sh + e[None, :],
                 vals.to(v_out_ptr.dtype.element_ty), mask=mv)


@triton.jit
def rope_rows(x, x_rows, row_mask, cos_ptr, sin_ptr, cs_rows, d, half):
    """``rw.rope`` on a loaded tile ``x`` ``[R, D]`` inside another kernel (the attention
    kernels rotate q this way): ``x_rows`` ``[R, 1]`` point at each row's head, ``cs_rows``
    ``[R, 1]`` are the offsets of its cos/sin rows; the first ``2 * half`` features rotate,
    the rest pass (cos 1, sin 0 there). cos/sin are rounded to x's dtype first, as rw.rope does."""
    m = row_mask & (d < 2 * half)[None, :]
    partner = tl.where(d < half, d + half, d - half)[None, :]  # rotate_half's source feature
    xp = tl.load(x_rows + partner, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + cs_rows + d[None, :], mask=m, other=1.0).to(x.dtype).to(tl.float32)
    sn = tl.load(sin_ptr + cs_rows + d[None, :], mask=m, other=0.0).to(x.dtype).to(tl.float32)
    sn = tl.where((d < half)[None, :], -sn, sn)
    return (x.to(tl.float32) * c + xp * sn).to(x.dtype)


def _launch(x, cos, sin, head_dim, out, start, out_strides, v=None, v_out=None):
    b, s, hd = x.shape
    heads, rot = hd // head_dim, cos.shape[-1]
    check(hd % head_dim == 0, "rope", f"{hd} features are not heads of {head_dim}")
    check(cos.shape == sin.shape and tuple(cos.shape[:-1]) == (b, s) and rot % 2 == 0
          and rot <= head_dim, "rope", f"cos {list(cos.shape)} / sin {list(sin.shape)} do not "
          f"fit x {list(x.shape)} with head_dim {head_dim}")
    x2 = x.reshape(b * s, hd)  # [tokens, H*D]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    c2 = cos.reshape(b * s, rot).contiguous()  # [tokens, R], a view of rw.rotary's output
    s2 = sin.reshape(b * s, rot).contiguous()
    start_ptr = start if isinstance(start, torch.Tensor) else c2  # unused unless a tensor
    block_half = triton.next_power_of_2(max(1, rot // 2))
    # A token's heads together, up to ~2048 elements a program: a decode step's 32 heads of
    # 64 are one program per token, not 32 programs of 64 elements.
    width = max(block_half, triton.next_power_of_2(head_dim) // 2 if v is not None else 1)
    block_h = min(triton.next_power_of_2(heads), max(1, 1024 // width))
    v2 = v.reshape(b * s, hd) if v is not None else x2  # [tokens, H*D]; unused without v
    if v2.stride(-1) != 1:
        v2 = v2.contiguous()
    v_out_strides = (v_out.stride(0), v_out.stride(2), v_out.stride(1)) if v is not None else (0, 0, 0)
    rope_kernel[(b * s, triton.cdiv(heads, block_h))](
        x2, c2, s2, out, start_ptr, v2, v_out if v is not None else out, s,
        0 if isinstance(start, torch.Tensor) else start, heads, head_dim, rot // 2,
        x2.stride(0), c2.stride(0), *out_strides, v2.stride(0), *v_out_strides,
        1 if isinstance(start, torch.Tensor) and start.numel() == b and b > 1 else 0,
        START_FROM_PTR=isinstance(start, torch.Tensor), HAS_V=v is not None, BLOCK_H=block_h,
        BLOCK_HALF=block_half, BLOCK_D=triton.next_power_of_2(max(1, head_dim - rot)),
        BLOCK_HD=triton.next_power_of_2(head_dim))


def rope_operands(cos, sin, b: int, s: int, head_dim: int, x: torch.Tensor, kernel: str):
    """``cos``/``sin`` ``[B, S, R]`` as ``[B*S, R]`` rows (views; the kernel rounds them to
    ``x``'s dtype, as ``rw.rope`` does first) and ``R / 2``, for a kernel that rotates ``x``
    itself; without them, placeholders its ``HAS_ROPE=False`` build never reads."""
    if cos is None:
        return x, x, 0
    rot = cos.shape[-1]
    check(sin is not None and cos.shape == sin.shape and tuple(cos.shape[:-1]) == (b, s)
          and rot % 2 == 0 and rot <= head_dim, kernel,
          f"cos {list(cos.shape)} / sin {list(getattr(sin, 'shape', []))} do not fit {b} rows "
          f"of {s} tokens with head_dim {head_dim}")
    return cos.reshape(b * s, rot).contiguous(), sin.reshape(b * s, rot).contiguous(), rot // 2


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``rw.rope``: ``x`` ``[B, S, H*D]`` -> rotated, same shape."""
    b, s, hd = x.shape
    check(out is None or (out.shape == x.shape and out.stride(-1) == 1), "rope",
          f"out must be shaped like x {list(x.shape)}, last dim contiguous")
    out = torch.empty(b, s, hd, dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, cos, sin, head_dim, out, 0, (out.stride(0), out.stride(1), head_dim))
    return out


def rope_into_cache(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                    cache: torch.Tensor, start: int | torch.Tensor,
                    v: torch.Tensor | None = None, v_cache: torch.Tensor | None = None) -> None:
    """Rotate ``k`` ``[B, S, Hkv*D]`` and write it into ``cache`` ``[B, Hkv, L, D]`` at
    positions ``[start, start + S)``: ``FuseRoPE``'s K path, one read and one write.
    ``start`` may be a one-element device tensor (a CUDA-graph decode step), or a ``[B]``
    one, each row's own (the steps of speculative rounds; kept within the cache by the
    caller: a device start is never read on the host). With ``v``
    and ``v_cache`` (same shapes as ``k`` and ``cache``), V is stored by the same launch."""
    b, s, hd = k.shape
    check((v is None) == (v_cache is None) and (v is None or (
          v.shape == k.shape and v_cache.shape == cache.shape and v_cache.stride(3) == 1)),
          "rope_into_cache", "v and v_cache must come together, shaped like k and cache")
    check(cache.dim() == 4 and cache.shape[0] == b and cache.shape[1] * head_dim == hd
          and cache.shape[3] == head_dim and cache.stride(3) == 1, "rope_into_cache",
          f"cache {list(cache.shape)} does not hold k {list(k.shape)} as heads of {head_dim}")
    if isinstance(start, torch.Tensor):
        check(start.numel() in (1, b) and start.dim() <= 1 and start.device == k.device
              and start.dtype in (torch.int32, torch.int64)
              and (start.numel() == 1 or start.stride(0) == 1), "rope_into_cache",
              f"a device start must be a contiguous int tensor of 1 or {b} elements on "
              f"{k.device}, got {start.dtype} {list(start.shape)} (strides "
              f"{list(start.stride())}) on {start.device}")
    else:  # a device tensor is never read here: under
        # CUDA-graph capture, even formatting it into the message would sync the stream
        check(0 <= start <= cache.shape[2] - s, "rope_into_cache",
              f"positions [{start}, {start} + {s}) are outside a cache of {cache.shape[2]}")
    _launch(k, cos, sin, head_dim, cache, start, (cache.stride(0), cache.stride(2), cache.stride(1)),
            v, v_cache)
