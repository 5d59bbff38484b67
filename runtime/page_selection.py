"""Quest at decode: per-page key bounds kept beside a layer's cache, and the pages a query
reads (``Quest``, ``rewriter.ops.select_pages``).

Each cache with a page selection keeps, per row and KV head, the per-channel maximum and
minimum key of every page of ``page`` cache positions (``KVCache.bounds``, ``[B, Hkv, P,
D]`` each), updated after every write for the pages it touched, over the row's real keys
only (left padding and positions not yet written count as absent): a prompt recomputes
the pages it wrote, a one-token step folds its key into its page's bounds. A one-token step
scores the pages written before it (the bounds of pages up to its position) and reads
``budget + recent`` tokens per KV head plus its own; a prompt is attended densely and
selects nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.ops import page_scores, pages_to_tokens, with_recent


def refresh_bounds(step, cache_id: int, page: int, k_cache: Tensor) -> None:
    """Recompute the bounds of the pages this step wrote, from ``k_cache`` ``[B, Hkv, L, D]``.

    Pages count a row's real tokens (cache position minus its left padding), so a row's
    pages, and what it selects, do not depend on the rows batched with it."""
    b, h, length, d = k_cache.shape
    device = k_cache.device
    page = min(page, length)  # a page past the cache is one page of it: the same bounds
    pages = -(-length // page)
    if cache_id not in step.cache.bounds:
        shape = (b, h, pages, d)
        step.cache.bounds[cache_id] = (
            torch.full(shape, float("-inf"), dtype=k_cache.dtype, device=device),
            torch.full(shape, float("inf"), dtype=k_cache.dtype, device=device))
    high, low = step.cache.bounds[cache_id]
    if step.per_row:
        raise NotImplementedError("page bounds with per-row steps (speculative decoding)")
    pad = step.pad if step.pad is not None else torch.zeros(b, dtype=torch.int64, device=device)
    start = _starts(step, b)
    if step.length == 1:
        _add_key(high, low, k_cache, start, pad, page)
        return
    end = start + step.length  # [B] cache positions written: [start, end)
    first = (start - pad).clamp(min=0) // page  # [B] first real page touched
    last = (end - 1 - pad).clamp(min=0) // page
    count = int((last - first).max()) + 1  # the most pages any row touched
    slots = pad[:, None] + first[:, None] * page + torch.arange(count * page, device=device)  # [B, n]
    real = (slots < end[:, None]) & (slots >= pad[:, None])  # [B, count*page]
    index = slots.clamp(max=length - 1)[:, None, :, None].expand(b, h, -1, d)
    keys = k_cache.gather(2, index)  # [B, Hkv, count*page, D]
    real = real[:, None, :, None]
    blocks = lambda x: x.view(b, h, count, page, d)  # noqa: E731
    hi = blocks(keys.masked_fill(~real, float("-inf"))).amax(3)  # [B, Hkv, count, D]
    lo = blocks(keys.masked_fill(~real, float("inf"))).amin(3)
    where = (first[:, None] + torch.arange(count, device=device)).clamp(max=pages - 1)  # [B, count]
    where = where[:, None, :, None].expand(b, h, count, d)
    high.scatter_(2, where, hi)
    low.scatter_(2, where, lo)


def _add_key(high: Tensor, low: Tensor, k_cache: Tensor, pos: Tensor, pad: Tensor,
             page: int) -> None:
    """A one-token step: fold the key each row wrote at cache position ``pos`` ``[B]`` into
    its page's bounds (or start them, for the first key of a page), reading that key only,
    not the page again; no host sync."""
    b, h, _, d = k_cache.shape
    real = pos - pad  # [B] the row's real tokens before this one
    at = (real // page).clamp(0, high.shape[2] - 1)[:, None, None, None].expand(b, h, 1, d)
    key = k_cache.gather(2, pos[:, None, None, None].expand(b, h, 1, d))  # [B, Hkv, 1, D]
    opens = (real % page == 0)[:, None, None, None]  # a new page: earlier bounds are stale
    high.scatter_(2, at, torch.where(opens, key, torch.maximum(high.gather(2, at), key)))
    low.scatter_(2, at, torch.where(opens, key, torch.minimum(low.gather(2, at), key)))


def select_pages(step, q: Tensor, k: Tensor, cache_id: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, page: int, budget: int, recent: int = 0) -> Optional[Tensor]:
    """``[B, Hkv, 1, budget + recent]`` cache positions for a one-token step (-1: none): the
    best pages written before its last ``recent`` tokens, by their bounds, then those
    tokens; None for a longer step."""
    if step.length != 1 or step.tree is not None:
        return None
    b = q.shape[0]
    device = q.device
    recent = min(recent, step.end)  # never wider than the positions the step can see
    page = min(page, step.cache.max_len)  # a page past the cache is one page of it (as its bounds)
    if cache_id not in step.cache.bounds:  # nothing written before: the token sees itself
        return torch.full((b, num_kv_heads, 1, 1 + recent), -1, dtype=torch.int64, device=device)
    high, low = step.cache.bounds[cache_id]  # written by this layer's earlier steps
    # score the pages up to the step's end only, not every allocated one (a replayed
    # step's end is the cache's length: all of them)
    used = -(-step.end // page)
    high, low = high[:, :, :used], low[:, :, :used]
    pages = high.shape[2]
    pad = step.pad if step.pad is not None else torch.zeros(b, dtype=torch.int64, device=device)
    current = _starts(step, b)
    seen = current - pad  # [B] real tokens before this one
    p = torch.arange(pages, device=device)
    before = seen - recent  # [B] the pages give real tokens before the local window
    valid = p[None] * page < before[:, None]  # [B, P]
    qh = q.view(b, 1, num_heads, head_dim).transpose(1, 2)  # [B, Hq, 1, D]
    scores = page_scores(qh.float(), high[:, :, None].float(), low[:, :, None].float(),
                         valid[:, None, None])  # [B, Hkv, 1, P]
    # never wider than the cache: a budget past it would make every step read more than dense
    width = min(budget, pages * page)
    tokens = pages_to_tokens(scores, valid[:, None, None], page, width, before.reshape(b, 1, 1))
    tokens = with_recent(tokens, seen.reshape(b, 1, 1), recent)  # [B, Hkv, 1, width + recent]
    return torch.where(tokens >= 0, tokens + pad.reshape(b, 1, 1, 1), -1)  # real -> cache


def _starts(step, b: int) -> Tensor:
    """``[B]``: each row's first cache position in the step (a device start as it is)."""
    if step.on_device:
        return step.start.expand(b)
    return torch.full((b,), step.start, device=step.cache.device)
