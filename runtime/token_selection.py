"""TidalDecode at decode: a selection layer's query picks the ``top_k`` cached tokens its
head group attends to most, and the layers after it attend to those and the current token
only (``TidalDecode``). The whole cache is kept; a prompt (a step of several tokens) is
attended densely and selects nothing, as TidalDecode leaves prefill dense.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.ops import top_tokens, with_recent
from rewriter.maths.sdpa import sdpa


def select_tokens(step, q: Tensor, k: Tensor, cache_id: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, top_k: int, recent: int = 0) -> Optional[Tensor]:
    """``[B, Hkv, 1, top_k + recent]`` cache positions for a one-token step (-1: none): the
    top-k read from cache ``cache_id`` among the tokens before the last ``recent``, then
    those; None for a longer step. The step's own slot is never scored (``_selectable``),
    so this may run before its layer's attention writes it (``select_own``)."""
    if step.length != 1 or step.tree is not None:
        return None
    b = q.shape[0]
    top_k, recent = min(top_k, step.end), min(recent, step.end)  # never wider than the cache
    keys = step.cache.k[cache_id][:, :, :step.end]  # [B, Hkv, end, D]
    qh = q.view(b, 1, num_heads, head_dim).transpose(1, 2)  # [B, Hq, 1, D]
    allowed = step.once(("selectable", recent), lambda: _selectable(step, b, recent))  # [B, 1, 1, end]
    chosen = top_tokens(qh, keys, allowed, top_k)  # [B, Hkv, 1, top_k]
    current = _current(step, b, 1)  # [B, 1, 1]
    start = step.pad.reshape(b, 1, 1) if step.pad is not None else None
    return with_recent(chosen, current, recent, start)


def selected_attention(step, qh: Tensor, k_cache: Tensor, v_cache: Tensor, select: Tensor,
                       scale: float, gqa: bool) -> Tensor:
    """qh ``[B, Hq, 1, D]`` over the cache positions ``select`` ``[B, Hkv, 1, k]`` names
    (-1: none) and the step's own token: ``k + 1`` keys read per KV head, not the cache."""
    b, hkv, _, k = select.shape
    index = selection_index(step, select)  # [B, Hkv, k + 1]
    rows = _flat_rows(index, k_cache.shape[2])  # [B*Hkv*(k + 1)]
    keys = _take(k_cache, rows, k + 1)  # [B, Hkv, k + 1, D]
    values = _take(v_cache, rows, k + 1)
    mask = (index >= 0)[:, :, None, :]  # [B, Hkv, 1, k + 1]: -1 entries unseen
    if gqa:
        mask = mask.repeat_interleave(qh.shape[1] // hkv, dim=1)
    return sdpa(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _flat_rows(index: Tensor, length: int) -> Tensor:
    """``[B * Hkv * n]``: positions ``index`` ``[B, Hkv, n]`` (-1 read as 0, masked later)
    as row numbers of a cache ``[B, Hkv, length, D]`` flattened to ``[B*Hkv*length, D]``."""
    b, h, _ = index.shape
    offset = torch.arange(b * h, device=index.device).view(b, h, 1) * length  # [B, Hkv, 1]
    return (index.clamp(min=0) + offset).reshape(-1)


def _take(cache: Tensor, rows: Tensor, n: int) -> Tensor:
    """Rows ``rows`` of ``cache`` ``[B, Hkv, L, D]`` -> ``[B, Hkv, n, D]``: one index_select
    of whole D-rows. (A gather with the index expanded over D reads one index per element:
    4-5x slower on a CPU, where it cost more than the attention it saved.)"""
    b, h, length, d = cache.shape
    return cache.reshape(b * h * length, d).index_select(0, rows).view(b, h, n, d)


def selection_index(step, select: Tensor) -> Tensor:
    """``[B, Hkv, k + 1]``: the positions ``select`` ``[B, Hkv, 1, k]`` names (-1: none),
    then the step's own; what a decode step with a selection reads."""
    b, hkv = select.shape[:2]
    return torch.cat([select[:, :, 0], _current(step, b, hkv)], dim=-1)


def _selectable(step, b: int, recent: int) -> Tensor:
    """``[B, 1, 1, end]``: the cached keys before the step's last ``recent`` tokens, padding
    excluded. Never the step's own slot, nor any after it: a selection made before its
    layer's attention (``select_own``) would read them unwritten or stale."""
    device = step.cache.device
    kj = torch.arange(step.end, device=device)
    current = torch.as_tensor(step.start, device=device)  # a device start as it is
    ok = (kj[None] < current.reshape(-1, 1) - recent).expand(b, -1)  # [B, end]
    if step.pad is not None:
        ok = ok & (kj[None] >= step.pad[:, None])
    return ok[:, None, None]


def _current(step, b: int, hkv: int) -> Tensor:
    """``[B, Hkv, 1]``: the cache position of the step's token."""
    device = step.cache.device
    pos = torch.as_tensor(step.start, device=device)
    return pos.reshape(-1, 1, 1).expand(b, hkv, 1).to(torch.int64)
