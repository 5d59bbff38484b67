"""``rw.attention`` on the Triton templates: the Triton backend's cached attention."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.codegen.decode_attention import decode_attention
from rewriter.codegen.prefill_attention import prefill_attention, tree_bits
from rewriter.codegen.rope import rope_into_cache

from .attention import Step, dense_attention, in_window_ring, write_kv
from .attention import cached_attention as torch_cached_attention
from .duo_cache import split_attention
from .kv_cache import CacheSpec
from .merged_cache import merged_attention
from .page_selection import refresh_bounds
from .ring_cache import ring_attention
from .token_selection import selection_index
from .window_ring import window_attention


def cached_attention(step: Step, q: Tensor, k: Tensor, v: Tensor, spec: CacheSpec,
                     cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
                     rotary: Optional[Tensor] = None, select: Optional[Tensor] = None) -> Tensor:
    """``rw.attention`` over cache ``spec.id`` (``spec``: the op's attributes, as
    ``runtime.attention.cached_attention`` takes them): decode or prefill kernel by step length;
    with ``cos``/``sin`` (``FuseRoPE``) K is rotated by the kernel that writes the cache
    (V with it) and q by the attention kernel: no launch of its own for either. A step
    whose start is per row (speculative decoding after ragged acceptance, and every step of
    a static round, ``runtime.replay``) runs the prefill kernel with each row's start, read
    on the device; with a selection (TidalDecode, Quest), or a token tree under a sliding
    window, it runs the torch path. A tree runs the prefill kernel with each node's
    ancestors as a bit set. A decode step with a
    selection (``select``: TidalDecode, Quest) passes the decode kernel its per-KV-head
    position lists, so it reads those keys only. A sink + window ring (``StreamingAttention``,
    DuoAttention's streaming heads) runs its one-token steps through the decode kernel too,
    over the ring's visible slots, the sinks scored by the query rotated back; its writes
    and longer steps are the torch path's (``runtime.ring_cache``); so does a sliding window
    kept in a ring (``runtime.window_ring``). A MiniCache pair's
    K/V are restored by torch (``runtime.merged_cache``) and attended by the kernels."""
    if spec.merge is not None:
        return merged_attention(step, q, k, v, spec, cos, sin, _restored_attention)
    if spec.full_heads is not None:  # DuoAttention: full heads here, the others in a ring
        return split_attention(cached_attention, step, q, k, v, spec, cos, sin, rotary,
                               kernel=decode_attention)
    if spec.sinks is not None:  # a sink + window ring (runtime.ring_cache): decode by the kernel
        return ring_attention(step, q, k, v, spec, cos, sin, rotary, kernel=decode_attention)
    if in_window_ring(step, spec, select):  # a sliding window in a ring: decode by the kernel
        return window_attention(step, q, k, v, spec, cos, sin, kernel=decode_attention)
    window, page = spec.window, spec.page
    if (step.per_row and (select is not None or page is not None)) or \
            (step.tree is not None and (window is not None or page is not None)):
        return torch_cached_attention(step, q, k, v, spec, cos, sin, select=select)
    num_heads, num_kv_heads, head_dim, scale = (spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                                spec.scale)
    b, s, _ = q.shape
    k_cache, v_cache = step.cache.k[spec.id], step.cache.v[spec.id]
    split = lambda x: x.view(b, s, num_kv_heads, head_dim).transpose(1, 2)  # noqa: E731  [B, Hkv, S, D]
    if not spec.write:  # another layer's cache, written by its owner (ShareKV)
        pass
    elif cos is not None:  # q is rotated inside the attention kernel
        rope_into_cache(k, cos, sin, head_dim, k_cache, step.start,
                        v=v, v_cache=v_cache)  # K rotated and V, one launch
    else:
        write_kv(step, k_cache, v_cache, split(k), split(v))
    if page is not None and not spec.read_after:
        # Quest: the bounds of the pages just written, by the last op reading the cache
        # (the selections before it score the pages as they were)
        refresh_bounds(step, spec.id, page, k_cache)
    start = step.pad if step.pad is not None else step.once("zeros", lambda: _zeros(b, q.device))
    if s == 1 and step.tree is None and not step.per_row:
        end = step.once("end", lambda: step.start + 1) if step.on_device else step.end
        # TidalDecode, Quest: the kernel reads only the selected positions and this one
        index = None if select is None else selection_index(step, select)  # [B, Hkv, k + 1]
        out = decode_attention(q.view(b, num_heads, head_dim), k_cache, v_cache, end, scale,
                               start=start, window=window or 0, cos=cos, sin=sin, index=index)
        return out.view(b, 1, num_heads * head_dim)
    tree = step.once("tree_bits", lambda: tree_bits(step.tree)) if step.tree is not None else None
    return prefill_attention(q, k_cache, v_cache, num_heads, scale, q_start=step.start,
                             start=start, window=window or 0, cos=cos, sin=sin, tree=tree)


def _restored_attention(step: Step, q: Tensor, keys: Tensor, values: Tensor,
                        spec: CacheSpec) -> Tensor:
    """q ``[B, S, Hq*D]`` (rotated) over restored keys/values ``[B, Hkv, end, D]`` by the
    decode or prefill kernel -> ``[B, S, Hq*D]``; a tree under a window by torch."""
    if step.tree is not None and spec.window is not None:
        return dense_attention(step, q, keys, values, spec)
    b, s, _ = q.shape
    start = step.pad if step.pad is not None else step.once("zeros", lambda: _zeros(b, q.device))
    if s == 1 and step.tree is None:
        out = decode_attention(q.view(b, spec.num_heads, spec.head_dim), keys, values, step.end,
                               spec.scale, start=start, window=spec.window or 0)
        return out.view(b, 1, spec.num_heads * spec.head_dim)
    tree = step.once("tree_bits", lambda: tree_bits(step.tree)) if step.tree is not None else None
    return prefill_attention(q, keys, values, spec.num_heads, spec.scale, q_start=step.start,
                             start=start, window=spec.window or 0, tree=tree)


def _zeros(b: int, device) -> Tensor:
    return torch.zeros(b, dtype=torch.int64, device=device)
