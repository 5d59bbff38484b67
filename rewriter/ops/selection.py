"""Sparse attention's selections: TidalDecode's top tokens and Quest's top pages, as ops,
and the maths they share with the runtime's decode-time selection."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.ops.attend import _attention_fake
from rewriter.ops.registry import _register


def _select_tokens_fake(q, k, layer, num_heads, num_kv_heads, head_dim, top_k, recent=0):
    _attention_fake(q, k, k, layer, num_heads, num_kv_heads, head_dim, 1.0)
    return q.new_empty((q.shape[0], num_kv_heads, q.shape[1], top_k + recent), dtype=torch.int64)


@_register(fake=_select_tokens_fake)
def select_tokens(q: Tensor, k: Tensor, layer: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, top_k: int, recent: int = 0) -> Tensor:
    """TidalDecode's token selection: for every query and KV head, the ``top_k`` earlier
    positions its head group attends to most (softmax weights of the group's query heads,
    summed), then the ``recent`` positions just before the query, always kept (a local
    window; the top-k is chosen among the keys before it): ``[B, Hkv, S, top_k + recent]``,
    -1 where fewer exist. q ``[B, S, Hq*D]`` and k ``[B, S, Hkv*D]`` are the selection
    layer's (rotated); ``layer`` names its cache, which the runtime reads at decode (a
    prompt is attended densely and selects nothing)."""
    b, s, _ = q.shape
    # never wider than the sequence (the runtime caps at its cache): the same positions, and
    # an artifact that raises its own context cannot size this by top_k
    top_k, recent = min(top_k, s), min(recent, s)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    kh = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    i = torch.arange(s, device=q.device)
    earlier = torch.ones(s, s, dtype=torch.bool, device=q.device).tril(-1 - recent)  # j < i - recent
    chosen = top_tokens(qh, kh, earlier, top_k)  # [B, Hkv, S, top_k]
    return with_recent(chosen, i.expand(b, num_kv_heads, s), recent)


def _select_pages_fake(q, k, layer, num_heads, num_kv_heads, head_dim, page, budget, recent=0):
    _attention_fake(q, k, k, layer, num_heads, num_kv_heads, head_dim, 1.0)
    return q.new_empty((q.shape[0], num_kv_heads, q.shape[1], budget + recent), dtype=torch.int64)


@_register(fake=_select_pages_fake)
def select_pages(q: Tensor, k: Tensor, layer: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, page: int, budget: int, recent: int = 0) -> Tensor:
    """Quest's page selection: earlier keys in pages of ``page`` tokens, each page bounded
    by the per-channel minimum and maximum of its keys; a query scores a page by the upper
    bound of ``q·k`` over it (``sum_d max(q_d min_d, q_d max_d)``, the largest over its KV
    head's query group) and keeps the ``budget // page`` best pages, then the ``recent``
    positions just before it, always kept (a local window; pages are chosen among those
    with a key before it, and contribute only keys before it): ``[B, Hkv, S, budget +
    recent]`` earlier positions, -1 where fewer exist. q ``[B, S, Hq*D]`` and k ``[B, S,
    Hkv*D]`` are the layer's own (rotated); the runtime keeps the bounds beside the cache
    and selects at decode only (a prompt is attended densely)."""
    b, s, _ = q.shape
    # one page of S tokens holds the same keys as any longer page, and no width exceeds what
    # S tokens can fill: nothing here is sized by page, budget or recent beyond the sequence
    page, recent = min(page, s), min(recent, s)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2).float()  # [B, Hq, S, D]
    kh = k.view(b, s, num_kv_heads, head_dim).transpose(1, 2).float()  # [B, Hkv, S, D]
    pages = -(-s // page)
    budget = min(budget, pages * page)
    pad = pages * page - s
    blocks = F.pad(kh, (0, 0, 0, pad)).view(b, num_kv_heads, pages, page, head_dim)
    high, low = blocks.cummax(3).values, blocks.cummin(3).values  # prefix bounds in each page
    high, low = high.view(b, num_kv_heads, -1, head_dim), low.view(b, num_kv_heads, -1, head_dim)
    i = torch.arange(s, device=q.device)[:, None]  # [S, 1] queries
    p = torch.arange(pages, device=q.device)[None]  # [1, P]
    last = torch.minimum((p + 1) * page, i) - 1  # [S, P]: page p's last key before query i
    # bounds cover every earlier key of the page (as the runtime's, kept as keys are written);
    # a page is a candidate if it holds a key before the local window
    valid = p * page < i - recent
    idx = last.clamp(min=0).view(1, 1, -1, 1).expand(b, num_kv_heads, -1, head_dim)
    hi = high.gather(2, idx).view(b, num_kv_heads, s, pages, head_dim)  # [B, Hkv, S, P, D]
    lo = low.gather(2, idx).view(b, num_kv_heads, s, pages, head_dim)
    end = (i[:, 0] - recent).expand(b, num_kv_heads, s)  # [B, Hkv, S]: pages give keys before it
    chosen = pages_to_tokens(page_scores(qh, hi, lo, valid), valid, page, budget, end)
    return with_recent(chosen, i[:, 0].expand(b, num_kv_heads, s), recent)


def with_recent(chosen: Tensor, end: Tensor, recent: int, start: Optional[Tensor] = None) -> Tensor:
    """``chosen`` ``[B, Hkv, S, k]`` followed by the ``recent`` positions before ``end``
    (broadcast to ``[B, Hkv, S]``): ``[B, Hkv, S, k + recent]``, -1 for those before
    ``start`` (default 0: the row's first real token)."""
    if recent == 0:
        return chosen
    window = end[..., None] - recent + torch.arange(recent, device=chosen.device)  # [B, Hkv, S, r]
    first = 0 if start is None else start[..., None]
    window = torch.where(window >= first, window, -1).expand(*chosen.shape[:-1], recent)
    return torch.cat([chosen, window], dim=-1)


def page_scores(qh: Tensor, hi: Tensor, lo: Tensor, valid: Tensor) -> Tensor:
    """qh ``[B, Hq, S, D]``, page bounds hi/lo ``[B, Hkv, S, P, D]``, ``valid`` broadcast to
    ``[B, Hkv, S, P]`` -> ``[B, Hkv, S, P]`` upper bounds of ``q·k``, the largest over each
    KV head's query group (-inf for pages without keys)."""
    b, hq, s, d = qh.shape
    hkv = hi.shape[1]
    qg = qh.view(b, hkv, hq // hkv, s, d).transpose(2, 3)  # [B, Hkv, S, G, D]
    # max(q*hi, q*lo) per channel is q*hi where q >= 0 and q*lo where q < 0 (hi >= lo): two
    # products, not two [.., P, D] temporaries. Pages without keys (bounds -inf/+inf) may
    # come out NaN; they are not valid and are masked.
    bound = (qg.clamp(min=0) @ hi.transpose(-1, -2)
             + qg.clamp(max=0) @ lo.transpose(-1, -2))  # [B, Hkv, S, G, P]
    return bound.amax(3).masked_fill(~valid, float("-inf"))


def pages_to_tokens(scores: Tensor, valid: Tensor, page: int, budget: int, end: Tensor,
                    start: Optional[Tensor] = None) -> Tensor:
    """The best ``budget // page`` pages of ``scores`` ``[B, Hkv, S, P]`` as token positions
    ``[B, Hkv, S, budget]``: those in ``[start, end)`` (broadcast to ``[B, Hkv, S]``), -1
    elsewhere and past the chosen pages."""
    b, hkv, s, pages = scores.shape
    n = min(budget // page, pages)
    best = scores.topk(n, dim=-1)  # [B, Hkv, S, n]
    ok = valid.expand(b, hkv, s, pages).gather(-1, best.indices)[..., None]  # [B, Hkv, S, n, 1]
    tokens = best.indices[..., None] * page + torch.arange(page, device=scores.device)  # [.., n, page]
    keep = ok & (tokens < end[..., None, None])
    if start is not None:
        keep = keep & (tokens >= start[..., None, None])
    tokens = torch.where(keep, tokens, -1).flatten(-2)  # [B, Hkv, S, n * page]
    return F.pad(tokens, (0, budget - tokens.shape[-1]), value=-1)


def top_tokens(qh: Tensor, kh: Tensor, allowed: Tensor, top_k: int) -> Tensor:
    """qh ``[B, Hq, S, D]``, kh ``[B, Hkv, T, D]``, ``allowed`` broadcast to ``[B, 1, S, T]``
    -> ``[B, Hkv, S, top_k]`` positions by summed group attention weight, -1 past the
    allowed ones."""
    b, hq, s, d = qh.shape
    hkv, t = kh.shape[1], kh.shape[2]
    g = hq // hkv
    # Query head h reads KV head h // g: one product per KV head over its whole group, so
    # the keys are read once, not copied g times (the cache is what a decode step is bound by).
    qg = qh.float().reshape(b, hkv, g * s, d)  # [B, Hkv, G*S, D]
    scores = (qg @ kh.float().transpose(-1, -2)).view(b, hkv, g, s, t) / math.sqrt(d)
    seen = allowed.expand(b, 1, s, t)[:, :, None]  # [B, 1, 1, S, T]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
    weights = weights.sum(2)  # [B, Hkv, S, T]
    k = min(top_k, t)
    best, idx = weights.topk(k, dim=-1)  # [B, Hkv, S, k]
    ok = seen[:, :, 0].expand(b, hkv, s, t).gather(-1, idx)
    idx = torch.where(ok, idx, -1)
    return F.pad(idx, (0, top_k - k), value=-1)
