"""DuoAttention's split layers: some KV heads keep a full cache, the others a sink + window
ring, in two tensor pairs (``CacheSpec.parts``: the full heads under the layer's cache id,
the ring under ``ring_part(id)``).

A split layer's step gathers the full heads' query groups and K/V into one attention over
the full cache (the backend's own, so the Triton backend runs its kernels on it) and the
rest into a ring attention (``runtime.ring_cache``), then puts each head's output back in
its place. Keys of both parts are rotated at their true positions, as the model computes
them; only the ring heads see the sinks at StreamingLLM's positions.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Optional

import torch
from torch import Tensor

from .kernels import KERNELS
from .kv_cache import CacheSpec, ring_part
from .ring_cache import ring_attention


def split_attention(attend: Callable, step, q: Tensor, k: Tensor, v: Tensor, spec: CacheSpec,
                    cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
                    rotary: Optional[Tensor] = None, kernel: Optional[Callable] = None) -> Tensor:
    """q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``: KV heads
    ``spec.full_heads`` and their query groups through ``attend`` (a backend's cached
    attention) on cache ``spec.id``, the others through the ring ``ring_part(spec.id)``
    (one-token steps through ``kernel``, a backend's decode kernel, when given)."""
    head_dim = spec.head_dim
    if cos is not None:  # FuseRoPE: rotate once, before the heads are split
        q, k = KERNELS["rope"](q, cos, sin, head_dim), KERNELS["rope"](k, cos, sin, head_dim)
    b, s, _ = q.shape
    groups = spec.num_heads // spec.num_kv_heads
    full_kv, ring_kv, full_q, ring_q = _head_indices(spec.full_heads, spec.num_kv_heads, groups,
                                                     q.device)
    qh = q.view(b, s, spec.num_heads, head_dim)  # [B, S, Hq, D]
    kh, vh = k.view(b, s, spec.num_kv_heads, head_dim), v.view(b, s, spec.num_kv_heads, head_dim)

    def pick(x: Tensor, idx: Tensor) -> Tensor:  # [B, S, H, D] -> [B, S, len(idx)*D]
        return x.index_select(2, idx).reshape(b, s, -1)

    whole_spec, ring_spec = _parts(spec)
    whole = attend(step, pick(qh, full_q), pick(kh, full_kv), pick(vh, full_kv), whole_spec)
    ring = ring_attention(step, pick(qh, ring_q), pick(kh, ring_kv), pick(vh, ring_kv),
                          ring_spec, rotary=rotary, kernel=kernel)
    out = torch.empty_like(qh)  # [B, S, Hq, D]
    out.index_copy_(2, full_q, whole.view(b, s, -1, head_dim))
    out.index_copy_(2, ring_q, ring.view(b, s, -1, head_dim))
    return out.view(b, s, spec.num_heads * head_dim)


@functools.cache
def _parts(spec: CacheSpec) -> tuple[CacheSpec, CacheSpec]:
    """The attributes of a split layer's two attentions: its full heads' over the whole
    cache (no window), and the ring heads' over the ring. Made once per layer."""
    full = len(spec.full_heads)
    rest = sum(h not in spec.full_heads for h in range(spec.num_kv_heads))  # as _head_indices
    groups = spec.num_heads // spec.num_kv_heads
    whole = replace(spec, num_heads=full * groups, num_kv_heads=full, window=None, sinks=None,
                    full_heads=None, page=None)
    ring = replace(spec, id=ring_part(spec.id), num_heads=rest * groups, num_kv_heads=rest,
                   full_heads=None, page=None)
    return whole, ring


_INDICES: dict = {}


def _head_indices(full_heads: tuple, num_kv_heads: int, groups: int, device):
    """Index tensors of the full and ring KV heads and of their query heads (query head
    ``h`` belongs to KV head ``h // groups``). Made once per split and device, from Python
    lists, so a decode step captured as a CUDA graph makes none (and never syncs)."""
    key = (full_heads, num_kv_heads, groups, str(device))
    if key not in _INDICES:
        full = list(full_heads)
        ring = [h for h in range(num_kv_heads) if h not in full_heads]
        queries = lambda heads: [h * groups + j for h in heads for j in range(groups)]  # noqa: E731
        _INDICES[key] = tuple(torch.tensor(x, dtype=torch.int64, device=device)
                              for x in (full, ring, queries(full), queries(ring)))
    return _INDICES[key]
