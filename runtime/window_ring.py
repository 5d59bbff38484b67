"""Sliding-window caches kept in a ring: a layer whose attention sees only the last
``window`` tokens (Mistral's layers, Gemma 3's local ones) holds ``window`` slots, plus a
slack where steps are rolled back, whatever the sequence's length.

A cache position ``p`` lives in slot ``p % R`` (``R``: the ring's slots), so each slot holds
the latest position of its class written so far, and what a slot holds follows from the
row's next position ``n`` alone: ``n - 1 - ((n - 1 - j) mod R)`` for slot ``j`` (none where
negative). Nothing but the K/V tensors is stored, and every mask is computed from the
step's start (on the device, so a CUDA-graph step can use it too). Positions, not real
indices, name the slots: left padding takes slots as it takes positions in a full cache,
hidden by the same ``first_real`` test, and a position's slot needs no row's padding, so
compaction (``KVCache.move``, a token tree's accepted path) moves ``src % R`` to ``dst % R``.

The slack rule. A one-token step writes its key first, over position ``n - R``, which no
query at ``n`` or later sees when ``R >= window``. A step of ``T`` tokens reads the ring as
it was plus its own keys and is written after, keeping only its last ``R`` tokens (earlier
ones share a slot with a later one): no query of a step loses a key to the same step, so a
prompt of any length, in chunks or whole, needs no slack. Rolling back is what needs it:
speculative decoding writes ``T`` tokens at ``n .. n + T - 1`` (drafts, then the verify
step over the same positions, or a token tree) and keeps ``n'`` of them, ``n' >= n + 1``
(the verified step's first token is the one already accepted). The rejected tokens stay in
their slots and destroyed positions up to ``n + T - 1 - R``; the masks take those slots to
hold exactly such positions, ``R`` before, so they are hidden as long as no query at ``n'``
or later is within ``window`` of them: ``R >= window + T - 2``. The engine gives the ring
the strategy's ``cache_slack()`` (the positions it reserves past the end anyway, ``2T``),
so ``R = window`` under plain decoding, the memory the model's design promises.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from rewriter.maths.mask import visible
from rewriter.maths.sdpa import sdpa

from .kernels import KERNELS
from .ring_cache import step_keys


def window_attention(step, q: Tensor, k: Tensor, v: Tensor, spec, cos: Optional[Tensor] = None,
                     sin: Optional[Tensor] = None, kernel: Optional[Callable] = None) -> Tensor:
    """``rw.attention`` with ``spec.window`` over its ring (``step.cache.spans``): q ``[B, S,
    Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``. ``kernel`` (a backend's
    ``decode_attention``) serves one-token steps, reading the visible slots by index."""
    hq, hkv, d, window = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.window
    if cos is not None:
        q, k = KERNELS["rope"](q, cos, sin, d), KERNELS["rope"](k, cos, sin, d)
    b, s, _ = q.shape
    k_ring, v_ring = step.cache.k[spec.id], step.cache.v[spec.id]  # [B, Hkv, R, D]
    slots = k_ring.shape[2]
    new_k = k.view(b, s, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
    new_v = v.view(b, s, hkv, d).transpose(1, 2)
    qh = q.view(b, s, hq, d).transpose(1, 2)  # [B, Hq, S, D]
    first = step.once("window_first", lambda: first_position(step, b))  # [B]
    if s == 1 and step.tree is None:
        if spec.write:  # else written by the owner this step (ShareKV)
            _write(step, k_ring, v_ring, new_k, new_v, first)
        mask = step.once(("window_decode", window, slots),
                         lambda: _decode_mask(step, first, window, slots))  # [B, 1, 1, R] or None
        if kernel is not None:
            out = _kernel_decode(kernel, step, qh, k_ring, v_ring, mask, spec.scale, window)
            return out.reshape(b, 1, hq * d)  # [B, 1, Hq*D]
        out = sdpa(qh, k_ring, v_ring, attn_mask=mask, scale=spec.scale, enable_gqa=hq != hkv)
    else:
        keys, values = step_keys(step, spec, k_ring, v_ring, new_k, new_v, slots)  # [B, Hkv, R + S, D]
        mask = step.once(("window_step", window, slots),
                         lambda: _step_mask(step, first, window, slots))  # [B, 1, S, R + S]
        out = sdpa(qh, keys, values, attn_mask=mask, scale=spec.scale, enable_gqa=hq != hkv)
        if spec.write:
            _write(step, k_ring, v_ring, new_k, new_v, first)
    return out.transpose(1, 2).reshape(b, s, hq * d)  # [B, S, Hq*D]


def first_position(step, batch: int) -> Tensor:
    """``[B]``: the cache position of the step's first token in each row."""
    if step.on_device:  # [B], or one position for every row
        return step.start.expand(batch)
    return torch.full((batch,), step.start, dtype=torch.int64, device=step.cache.device)


def held(n: Tensor, slots: int) -> Tensor:
    """``[B, R]``: the position each slot holds once a row has written positions below
    ``n`` ``[B]`` (negative where it holds none)."""
    j = torch.arange(slots, device=n.device)  # [R]
    last = n[:, None] - 1  # [B, 1]
    return last - (last - j) % slots


def _decode_mask(step, first: Tensor, window: int, slots: int) -> Optional[Tensor]:
    """``[B, 1, 1, R]`` for a one-token step at ``first`` over the ring after its write;
    None where every slot is visible (a full ring of exactly the window, no padding)."""
    if not step.on_device and step.pad is None and slots == window and step.start + 1 >= slots:
        return None  # SDPA's fastest path
    keys = held(first + 1, slots)  # [B, R]
    pad = step.pad[:, None] if step.pad is not None else None  # [B, 1]
    return ((keys >= 0) & visible(first[:, None], keys, window, first_real=pad))[:, None, None]


def _step_mask(step, first: Tensor, window: int, slots: int) -> Tensor:
    """``[B, 1, S, R + S]`` for a step of several tokens over the ring as it was and the
    step's own keys: causal, or the step's token tree (``Step.tree``, its window measured
    by depth); a padding query sees itself only, so its softmax stays finite."""
    s = step.length
    old = held(first, slots)[:, None, :]  # [B, 1, R]
    pad = step.pad[:, None, None] if step.pad is not None else None  # [B, 1, 1]
    offsets = step.depth if step.tree is not None else torch.arange(s, device=first.device)
    at = (first[:, None] + offsets.to(first.device))[:, :, None]  # [B, S, 1]
    seen_old = (old >= 0) & visible(at, old, window, first_real=pad)  # [B, S, R]
    if step.tree is None:
        own = visible(at, at.transpose(1, 2), window, first_real=pad)  # [B, S, S]
    else:
        depth = step.depth.to(first.device)
        own = (step.tree.to(first.device) & (depth[:, None] - depth[None, :] < window))
        own = own.expand(len(first), s, s)  # [B, S, S]
    return torch.cat([seen_old, own], dim=2)[:, None]


def _write(step, k_ring: Tensor, v_ring: Tensor, new_k: Tensor, new_v: Tensor,
           first: Tensor) -> None:
    """Store the step's K/V ``[B, Hkv, S, D]`` at slots ``position % R``: only its last ``R``
    tokens, since an earlier one shares its slot with a later one (and no slot may be
    written twice in one step, whose order indexing does not define)."""
    slots, s = k_ring.shape[2], new_k.shape[2]
    keep = min(s, slots)
    if s == 1 and not step.on_device:  # a plain decode step: one slot, every row
        k_ring[:, :, step.start % slots] = new_k[:, :, 0]
        v_ring[:, :, step.start % slots] = new_v[:, :, 0]
        return
    slot = (first[:, None] + torch.arange(s - keep, s, device=first.device)) % slots  # [B, keep]
    rows = torch.arange(len(slot), device=slot.device)[:, None]  # [B, 1]
    k_ring[rows, :, slot] = new_k[:, :, s - keep:].transpose(1, 2)  # [B, keep, Hkv, D]
    v_ring[rows, :, slot] = new_v[:, :, s - keep:].transpose(1, 2)


def _kernel_decode(kernel: Callable, step, qh: Tensor, k_ring: Tensor, v_ring: Tensor,
                   mask: Optional[Tensor], scale: float, window: int) -> Tensor:
    """One token through a decode kernel: qh ``[B, Hq, 1, D]`` over the slots ``mask``
    ``[B, 1, 1, R]`` shows (all where None), named by an index ``[B, Hkv, R]`` (-1: not
    read) -> ``[B, Hq, D]``."""
    b, hkv, slots = qh.shape[0], k_ring.shape[1], k_ring.shape[2]
    index = None if mask is None else step.once(("window_index", window, slots), lambda: torch.where(
        mask[:, 0, 0], torch.arange(slots, device=mask.device), -1))  # [B, R]
    start = step.once("zeros", lambda: torch.zeros(b, dtype=torch.int64, device=qh.device))
    return kernel(qh[:, :, 0].contiguous(), k_ring, v_ring, slots, scale, start=start,
                  index=None if index is None else index[:, None].expand(b, hkv, slots))
