"""``sdpa``: ``F.scaled_dot_product_attention`` with a faster path for one-query steps of
bfloat16/float16 on a CPU.

ATen's CPU kernel is slow for exactly the call a decode step makes: one query per head
in bfloat16. On the project's 2-core AMD EPYC (torch 2.13) it took 0.17 ms for SmolLM2's
9 query heads over 300 cached keys and 2.1 ms over 4000, where the same call with two
queries takes 0.06 and 0.65: its cost does not grow with the queries, so a one-token step
pays the most per token. In float32 the kernel is fast (0.03 ms at 300 keys), and on a GPU
it is not this kernel at all; both are left to it.

For short caches the kernel is faster still, and keeps them (``_SMALL``).

The path here computes scores, softmax and the weighted sum in float32 from the bfloat16
inputs and rounds once, at the end: its output is float32 attention rounded (the kernel
also rounds its softmax weights to bfloat16 before the weighted sum, so its error is
larger, never smaller; ``tests/test_sdpa.py``). Queries are grouped under their key/value
head (``enable_gqa``), so the cache is read once per KV head, not once per query head.
``benchmarks/decode_attention.py`` times both: 1.3-2.1x faster than the kernel at 128-256
keys, 4-6x at 1024-4096, batch 1 and 4.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_LOW = (torch.bfloat16, torch.float16)
# float32 elements of K (and as many of V) made at once: rows of a batch are taken in
# groups under this, so 8 rows of an 8k cache do not build 100 MB of copies (measured:
# all 8 at once ran as slowly as the kernel, 33 ms; two rows at a time 7-9 ms).
_CHUNK = 1 << 22
# Below this many (row, query head, key) triples the kernel is faster: this path's few
# extra calls cost about 30 us, the kernel about 0.06 us a triple (SmolLM2's 9 heads at
# batch 1: even at 64 keys, the kernel ahead below, this path ahead from 128).
_SMALL = 1024


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
         scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """q ``[B, Hq, S, D]``, k/v ``[B, Hkv, T, D]``, ``attn_mask`` bool, broadcast to ``[B,
    Hq, S, T]`` (True = may attend) -> ``[B, Hq, S, D]``, as
    ``F.scaled_dot_product_attention``; a query that may attend to nothing gets zeros."""
    if not _grouped_case(q, k, v, attn_mask, enable_gqa):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                              enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    rows = max(1, _CHUNK // max(1, k[0].numel()))
    if rows >= q.shape[0]:
        return _grouped(q, k, v, attn_mask, scale)
    return torch.cat([_grouped(q[b:b + rows], k[b:b + rows], v[b:b + rows],
                               _rows(attn_mask, b, rows), scale)
                      for b in range(0, q.shape[0], rows)])


def _rows(mask: Optional[Tensor], start: int, n: int) -> Optional[Tensor]:
    """The mask of rows ``[start, start + n)``: a mask shared by every row is all of it."""
    return mask if mask is None or mask.shape[0] == 1 else mask[start:start + n]


def _grouped_case(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], gqa: bool) -> bool:
    """The slow kernel's case, with inputs this path reads as SDPA would (heads grouped
    only where SDPA would group them: ``enable_gqa``)."""
    return (q.device.type == "cpu" and q.dim() == 4 and q.shape[2] == 1 and q.shape[0] > 0
            and q.dtype in _LOW and k.dtype == q.dtype and v.dtype == q.dtype
            and k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0]
            and q.shape[1] % k.shape[1] == 0 and k.shape[3] == q.shape[3]
            and (gqa or q.shape[1] == k.shape[1])
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[0] in (1, q.shape[0])
                                  and mask.shape[1] in (1, q.shape[1])
                                  and mask.shape[2:] == (1, k.shape[2])))
            and q.shape[0] * q.shape[1] * k.shape[2] >= _SMALL)


def _grouped(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """One-query attention of ``_grouped_case``'s inputs, in float32: -> ``[B, Hq, 1, D]``."""
    b, hq, _, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, d).float().mul_(scale)  # [B, Hkv, G, D]: head h reads KV head h // G
    scores = qg @ k.float().transpose(-1, -2)  # [B, Hkv, G, T]
    if mask is None:
        weights = scores.softmax(-1)
    else:
        if mask.shape[1] == 1:  # every head alike
            seen = mask.reshape(mask.shape[0], 1, 1, t)  # [B or 1, 1, 1, T]
        else:  # per query head, in SDPA's order
            seen = mask.reshape(mask.shape[0], hkv, g, t)  # [B or 1, Hkv, G, T]
        weights = scores.masked_fill_(seen.logical_not(), float("-inf")).softmax(-1)
        sees = seen.any(-1, keepdim=True)  # [B or 1, Hkv or 1, G or 1, 1]
        if not sees.all():  # a query that sees no key: SDPA's CPU kernel gives zeros, softmax NaN
            weights = torch.where(sees, weights, 0.0)
    out = weights @ v.float()  # [B, Hkv, G, D]
    return out.reshape(b, hq, 1, d).to(q.dtype)


@contextlib.contextmanager
def kernel_only():
    """Every call to ATen's kernel while inside: to measure this path against it."""
    global _SMALL
    saved, _SMALL = _SMALL, math.inf
    try:
        yield
    finally:
        _SMALL = saved
