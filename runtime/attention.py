"""Attention over the KV cache, and the masks one step of the runtime needs.

A step writes ``S`` new tokens at cache positions ``[start, start + S)`` of every row and
lets them attend to positions ``[0, start + S)``. Batches of prompts of different lengths
are left-padded: row ``b``'s first ``pad[b]`` cache positions hold padding that no real
token may see. Token positions (for RoPE) are cache position minus ``pad[b]``, so
windows, measured in cache positions, mean the same as in token positions.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.errors import RewriterError
from rewriter.maths.mask import visible
from rewriter.maths.sdpa import sdpa

from .duo_cache import split_attention
from .kernels import KERNELS
from .kv_cache import CacheSpec, KVCache
from .merged_cache import merged_attention
from .page_selection import refresh_bounds
from .ring_cache import ring_attention
from .window_ring import window_attention
from .token_selection import selected_attention


def _check_bounds(start, length: int, end: Optional[int]) -> None:
    """A step's ``start`` is an int or an integer device tensor (``[]`` or ``[B]``), its
    keys' ``end`` covers an int start's tokens: anything else would index the cache
    wrongly (a float start) or read keys short of the step's own (a short end)."""
    if isinstance(start, Tensor):
        if start.dtype.is_floating_point or start.dtype == torch.bool or start.dim() > 1:
            raise ValueError(f"a step's device start is an integer [] or [B] tensor, got "
                             f"{start.dtype} of shape {list(start.shape)}")
        if end is None:
            raise ValueError("a step whose start is a device tensor needs its end")
    elif isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"a step's start is an int or a device tensor, got {type(start).__name__}")
    elif end is not None and end < start + length:
        raise ValueError(f"a step's end ({end}) is short of its tokens ({start} + {length})")


class Step:
    """One forward call of the runtime: where each row writes in the cache, and its masks.

    ``start`` is the first cache position the step's ``length`` tokens are written at: an
    int when every row writes at the same place (prefill, plain decode), or a device
    tensor, read on the device only, so that a CUDA graph can replay the step with the
    next token's value (``runtime.replay``): ``[B]`` when rows have their own lengths
    (speculative decoding, after rows accepted different numbers of tokens, and every step
    of a static round), a scalar (0-d) when every row writes at the same place (the static
    decode step, ``runtime.generate.static_decoder``). Keys ``[0, end)`` are read; ``end``
    defaults to ``start + length`` and must be given (an upper bound over rows, the
    cache's length in a replayed step) with a tensor ``start``.
    Rolling a row back is starting its next step earlier: what lies past a row's start is
    masked until it is written again, so rejected tokens are never copied or cleared.

    ``tree`` (``[S, S]`` bool, True where token i may see token j) replaces the causal
    order among the step's own tokens: a token tree verified at once (``rewriter.drafts.tree``),
    each node seeing the prefix, its ancestors and itself; ``depth`` ``[S]`` gives each
    node's distance from the root, which windows measure.
    """

    def __init__(self, cache: KVCache, start, length: int, pad: Optional[Tensor],
                 end: Optional[int] = None, tree: Optional[Tensor] = None,
                 depth: Optional[Tensor] = None):
        self.cache, self.start, self.length, self.pad = cache, start, length, pad
        self.tree, self.depth = tree, depth
        self.on_device = isinstance(start, Tensor)  # nothing about the start is read on the host
        self.per_row = self.on_device and start.dim() == 1
        _check_bounds(start, length, end)
        self.end = end if end is not None else start + length
        self._values: dict = {}

    def once(self, key, make):
        """A device value every layer of the step needs (``make()`` runs at the first
        layer): built once a step, not once a layer, which on a GPU is a kernel saved per layer."""
        if key not in self._values:
            self._values[key] = make()
        return self._values[key]

    def mask(self, window: Optional[int]) -> Optional[Tensor]:
        """Boolean ``[B or 1, 1, S, end]`` (True = may attend), or None when all keys are visible."""
        return self.once(("mask", window), lambda: self._build_mask(window))

    def _build_mask(self, window: Optional[int]) -> Optional[Tensor]:
        if self.tree is not None:
            return self._tree_mask(window)
        limited = window is not None and self.end > window
        if self.length == 1 and self.pad is None and not limited and not self.on_device:
            return None  # one new token that sees the whole cache: SDPA's fastest path
        device = self.cache.device
        offsets = torch.arange(self.length, device=device)
        if self.on_device:
            qi = (self.start.reshape(-1, 1) + offsets)[:, None, :, None]  # [B or 1, 1, S, 1]
        else:
            qi = (self.start + offsets)[None, None, :, None]  # [1, 1, S, 1]
        kj = torch.arange(self.end, device=device)  # [end]
        first_real = self.pad[:, None, None, None] if self.pad is not None else None  # [B, 1, 1, 1]
        return visible(qi, kj, window, first_real=first_real)  # [B or 1, 1, S, end]


    def _tree_mask(self, window: Optional[int]) -> Tensor:
        """``[B or 1, 1, S, end]``: keys before the row's start (within the window of the
        node's own position, start + depth), and the node's ancestors in the tree."""
        device = self.cache.device
        s = self.length
        start = self.start.reshape(-1, 1, 1, 1) if self.on_device else self.start  # [B or 1, 1, 1, 1]
        kj = torch.arange(self.end, device=device)  # [end]
        mask = (kj < start).expand(-1 if self.on_device else 1, 1, s, self.end).clone()
        if window is not None:
            position = start + self.depth[None, None, :, None]  # [B or 1, 1, S, 1]
            mask &= position - kj < window
        tree = self.tree.to(device)
        if window is not None:  # ancestors further than the window (a tiny window) too
            tree = tree & (self.depth[:, None] - self.depth[None, :] < window)
        if self.on_device:  # indexed on the device: slicing by a tensor would read it
            cols = self.start.reshape(-1, 1) + torch.arange(s, device=device)  # [B or 1, S]
            rows = torch.arange(len(cols), device=device)[:, None]  # [B or 1, 1]
            mask[rows, 0, :, cols] = tree.t()  # [B, S keys, S queries]
        else:
            mask[..., self.start:self.start + s] = tree
        if self.pad is not None:
            mask = mask & (kj >= self.pad[:, None, None, None])  # [B, 1, S, end]
        return mask


def cached_attention(step: Step, q: Tensor, k: Tensor, v: Tensor, spec: CacheSpec,
                     cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
                     rotary: Optional[Tensor] = None, select: Optional[Tensor] = None) -> Tensor:
    """``rw.attention`` with K/V written into cache ``spec.id`` first; ``spec`` holds the
    op's attributes (heads, head size, scale, window, sinks, full heads, page size),
    built once per attention node by lowering.

    q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``; with ``cos``/``sin``
    (``FuseRoPE``) q and k are rotated here first. With ``spec.sinks`` the cache is a ring
    (``runtime.ring_cache``); with ``spec.merge`` a MiniCache pair's (``runtime.merged_cache``);
    a sliding window the cache holds in a ring (``step.cache.spans``) is
    ``runtime.window_ring``'s.
    """
    if spec.merge is not None:  # MiniCache: restored K/V, attended here
        return merged_attention(step, q, k, v, spec, cos, sin, dense_attention)
    if spec.full_heads is not None:  # DuoAttention: full heads here, the others in a ring
        return split_attention(cached_attention, step, q, k, v, spec, cos, sin, rotary)
    if spec.sinks is not None:
        return ring_attention(step, q, k, v, spec, cos, sin, rotary)
    if in_window_ring(step, spec, select):  # a sliding window in a ring of its slots
        return window_attention(step, q, k, v, spec, cos, sin)
    num_heads, num_kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if cos is not None:
        q, k = KERNELS["rope"](q, cos, sin, head_dim), KERNELS["rope"](k, cos, sin, head_dim)
    b, s, _ = q.shape
    k_cache, v_cache = step.cache.k[spec.id], step.cache.v[spec.id]
    if spec.write:  # else another layer's cache, written by its owner (ShareKV)
        write_kv(step, k_cache, v_cache, k.view(b, s, num_kv_heads, head_dim).transpose(1, 2),
                 v.view(b, s, num_kv_heads, head_dim).transpose(1, 2))  # [B, Hkv, S, D]
    if spec.page is not None and not spec.read_after:
        # Quest: the bounds of the pages just written, by the last op reading the cache
        # (the selections before it score the pages as they were)
        refresh_bounds(step, spec.id, spec.page, k_cache)
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    if select is not None:  # TidalDecode: the selected tokens and this one
        out = selected_attention(step, qh, k_cache, v_cache, select, spec.scale,
                                 num_heads != num_kv_heads)
        return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)  # [B, 1, Hq*D]
    return dense_attention(step, q, k_cache[:, :, :step.end], v_cache[:, :, :step.end], spec)


def in_window_ring(step: Step, spec: CacheSpec, select: Optional[Tensor]) -> bool:
    """Whether the op's cache is a sliding-window ring (``runtime.window_ring``). A
    selection reads cache positions: ``cache_table`` keeps such caches whole, so a ring
    here is a table that does not match the graph (an edited artifact)."""
    if spec.id not in step.cache.spans:
        return False
    if select is not None or spec.window is None:
        raise RewriterError(f"cache {spec.id} is a sliding-window ring, but an attention op "
                            f"reading it has {'a selection' if select is not None else 'no window'}"
                            f": the cache table does not match the graph")
    return True


def dense_attention(step: Step, q: Tensor, keys: Tensor, values: Tensor, spec: CacheSpec) -> Tensor:
    """q ``[B, S, Hq*D]`` over keys/values ``[B, Hkv, end, D]`` under the step's mask ->
    ``[B, S, Hq*D]``."""
    b, s, _ = q.shape
    qh = q.view(b, s, spec.num_heads, spec.head_dim).transpose(1, 2)  # [B, Hq, S, D]
    out = sdpa(qh, keys, values, attn_mask=step.mask(spec.window), scale=spec.scale,
               enable_gqa=spec.num_heads != spec.num_kv_heads)
    return out.transpose(1, 2).reshape(b, s, spec.num_heads * spec.head_dim)  # [B, S, Hq*D]


def write_kv(step: Step, k_cache: Optional[Tensor], v_cache: Tensor, k: Optional[Tensor],
             v: Tensor) -> None:
    """Store the step's K and V ``[B, Hkv, S, D]`` at each row's cache positions (K skipped
    when ``k`` is None: a kernel wrote it already, as ``FuseRoPE`` does). A start on the
    device is written through index tensors made on the device: no host read, so the
    same write serves a CUDA graph's every replay."""
    pairs = [(v_cache, v)] if k is None else [(k_cache, k), (v_cache, v)]
    if step.on_device:
        rows, cols = step.once("rows", lambda: _row_positions(step, v.shape[0]))
    for cache, new in pairs:
        if step.on_device:  # row b's token j at start[b] + j
            cache[rows, :, cols] = new.transpose(1, 2)  # [B, S, Hkv, D]
        else:
            cache[:, :, step.start:step.end] = new


def _row_positions(step: Step, b: int) -> tuple[Tensor, Tensor]:
    """Index tensors ``[B, 1]`` (row) and ``[B or 1, S]`` (cache position) of a step whose
    start is on the device (``[B]``, or one for every row)."""
    device = step.start.device
    rows = torch.arange(b, device=device)[:, None]  # [B, 1]
    cols = step.start.reshape(-1, 1) + torch.arange(step.length, device=device)  # [B or 1, S]
    return rows, cols
