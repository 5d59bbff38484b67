"""MiniCache (Liu et al. 2024, arXiv 2405.14366): two adjacent layers' KV caches kept as one.

Per token and KV head, each layer's K (and V) vector is split into its magnitude and its
unit direction; the pair's two directions are merged by SLERP,

    e = sin((1 - t) W) / sin W * e_first + sin(t W) / sin W * e_second,
    W = arccos(e_first . e_second),

and only ``e`` is stored, with each layer's own magnitude: a layer's K is restored as
``e * |K|`` inside attention. Keys are merged after RoPE (both layers' keys at a position
get the same rotation, which keeps norms and angles). Tokens whose two directions differ
too much are retained: both layers' K and V as computed, in a bounded side buffer with
their positions, written over the restored ones.

Storage of a pair (``CacheSpec.parts`` and ``merge_parts``, allocated by ``KVCache``):
directions K and V ``[B, Hkv, max_len, D]`` under the first layer's id (``cache.k``,
``cache.v``); in ``cache.merged[id]`` the magnitudes ``[B, Hkv, max_len, 4]`` (K, V of the
first layer, then of the second), the side buffer ``[B, Hkv, C, 4, D]`` and its positions
``[B, Hkv, C]`` (-1: free), and per row and head the slots in use, the tokens that merged
because the buffer was full (``overflow``) and the running range of angular distances.

One step: the first layer truncates the side buffer to the positions before the step
(a sequence rewritten from there: a new prompt, a rewound chat), writes its new tokens'
directions and magnitudes and attends (its own new tokens exactly, past tokens merged);
the second layer merges its new tokens' directions with the first layer's (the step's
own K and V, kept on the step), applies the retention rule, writes, and attends.

Retention (the paper's prose: "keep highly distinct pairs unmerged"; its formula
``d_min + (d_max - d_min) * gamma`` read from the top): ``d`` is a token's angular
distance ``W / pi`` in [0, 1], the larger of its K's and its V's, per row and KV head;
``d_min``/``d_max`` run over the row's real tokens so far (padding left out; reset at
position 0), and a token is retained when ``d >= gamma * d_min + (1 - gamma) * d_max``,
i.e. it lies in the top ``gamma`` share of the range. ``gamma = 1`` retains every token,
and with ``retain = 1`` (a side slot per token) the pair gives the model's own attention:
that is the setting that keeps every token (exactly in float32: in a lower precision the
first layer attends to its step's own tokens as stored, direction times magnitude). A row
retains at most ``retain`` times its tokens so far (the buffer holds that share of the
allocated length, so a longer cache, reused, changes nothing); past it a token merges
anyway and ``overflow`` counts it. (xKV's re-implementation keeps originals of the
*close* tokens instead; not done here.)

The paper confirms: merging from the middle depth (start ``L // 2``), ``gamma = 0.05`` as
its best trade-off, and ``t = 0.5`` (the xKV re-implementation's setting). Chosen here: the
side buffer's capacity (``retain``, a share of the sequence), a running range rather than
one per step (a one-token decode step has no range of its own), one decision per token
and KV head on the larger of the K and V distances.

Steps must start on the host: a CUDA-graph step (``Step.on_device``) is refused, and so
are speculative strategies (``rewriter.ir.merging``).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from rewriter.errors import RewriterError

from .kernels import KERNELS
from .kv_cache import CacheSpec, KVCache


def merged_attention(step, q: Tensor, k: Tensor, v: Tensor, spec: CacheSpec,
                     cos: Optional[Tensor], sin: Optional[Tensor], attend: Callable) -> Tensor:
    """q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``: the step's K/V into the
    pair's stores, then ``attend(step, q, keys, values, spec)`` (a backend's attention over
    restored K/V ``[B, Hkv, end, D]``)."""
    if step.on_device:
        raise RewriterError("MiniCache's merged cache needs steps whose start is on the host "
                            "(no CUDA-graph decode: set engine.static_decode = False)")
    if cos is not None:  # FuseRoPE: merge the rotated keys
        rope = KERNELS["rope"]
        q, k = rope(q, cos, sin, spec.head_dim), rope(k, cos, sin, spec.head_dim)
    b, s, _ = k.shape
    kh = k.view(b, s, spec.num_kv_heads, spec.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    vh = v.view(b, s, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    if spec.second:
        _merge(step, spec, kh, vh)
    else:
        _write_first(step, spec, kh, vh)
    keys, values = restore(step.cache, spec, step.end)
    return attend(step, q, keys, values, spec)


def polar(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[..., D]`` -> (magnitude ``[...]``, unit direction ``[..., D]``), float32; a
    zero vector has direction zero."""
    x = x.float()
    norm = x.norm(dim=-1)
    return norm, x / norm.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def slerp(a: Tensor, b: Tensor, t: float) -> tuple[Tensor, Tensor]:
    """Unit directions ``a``, ``b`` ``[..., D]`` -> (their SLERP at ``t``, the angle ``W``
    ``[...]``); where ``sin W`` vanishes (equal or opposite directions) the linear mix."""
    omega = (a * b).sum(-1).clamp(-1.0, 1.0).arccos()
    so = omega.sin()
    safe = so > 1e-6
    so = torch.where(safe, so, 1.0)
    wa = torch.where(safe, ((1 - t) * omega).sin() / so, 1 - t)[..., None]
    wb = torch.where(safe, (t * omega).sin() / so, t)[..., None]
    return wa * a + wb * b, omega


def _write_first(step, spec: CacheSpec, kh: Tensor, vh: Tensor) -> None:
    """The pair's first layer: forget side entries at or past the step's start, write the
    new tokens' directions and magnitudes, keep its K/V ``[B, Hkv, S, D]`` for the second."""
    store, start, end = step.cache.merged[spec.id], step.start, step.end
    if start == 0:  # a new sequence: a new range of distances
        store["distance"][..., 0], store["distance"][..., 1] = math.inf, -math.inf
        store["overflow"].zero_()
    at = store["side_at"]  # [B, Hkv, C]
    at.masked_fill_(at >= start, -1)  # positions are stored in order: a suffix
    store["retained"].copy_((at >= 0).sum(-1))
    (mk, ek), (mv, ev) = polar(kh), polar(vh)
    step.cache.k[spec.id][:, :, start:end] = ek
    step.cache.v[spec.id][:, :, start:end] = ev
    store["magnitude"][:, :, start:end, 0] = mk
    store["magnitude"][:, :, start:end, 1] = mv
    step.once(("minicache", spec.id), lambda: (kh, vh))


def _merge(step, spec: CacheSpec, kh: Tensor, vh: Tensor) -> None:
    """The pair's second layer: SLERP its new directions with the first layer's, retain
    the most distinct tokens, write the merged directions and its magnitudes."""
    first = step.once(("minicache", spec.id), lambda: None)
    if first is None:
        raise RewriterError(f"MiniCache pair {spec.id}: its second layer ran without its first "
                            f"in this step")
    k1, v1 = first
    store, start, end = step.cache.merged[spec.id], step.start, step.end
    t, gamma, _ = spec.merge
    (mk, ek2), (mv, ev2) = polar(kh), polar(vh)
    ek, wk = slerp(polar(k1)[1], ek2, t)
    ev, wv = slerp(polar(v1)[1], ev2, t)
    positions = torch.arange(start, end, device=kh.device)  # [S]
    real = positions >= (step.pad[:, None, None] if step.pad is not None else 0)  # [B or 1, 1, S]
    keep = retention(store["distance"], torch.maximum(wk, wv) / math.pi, real, gamma)
    step.cache.k[spec.id][:, :, start:end] = ek
    step.cache.v[spec.id][:, :, start:end] = ev
    store["magnitude"][:, :, start:end, 2] = mk
    store["magnitude"][:, :, start:end, 3] = mv
    # each row retains at most retain x its tokens so far: the same tokens whatever the
    # allocated cache (a longer one, reused, has a larger buffer)
    tokens = end - step.pad if step.pad is not None else torch.full((1,), end, device=kh.device)
    cap = torch.ceil(tokens.double() * spec.merge[2] - 1e-9).long()[:, None, None]  # [B or 1, 1, 1]
    _to_side(store, keep, torch.stack([k1, v1, kh, vh], dim=3), start, cap)  # [B, Hkv, S, 4, D]


def retention(distance: Tensor, d: Tensor, real: Tensor, gamma: float) -> Tensor:
    """Which tokens stay unmerged, ``[B, Hkv, S]`` bool, from their angular distances ``d``
    ``[B, Hkv, S]``: the running range ``distance`` ``[B, Hkv, 2]`` (min, max) takes in the
    ``real`` tokens first, then those at or above ``gamma * min + (1 - gamma) * max``."""
    real = real.expand_as(d)
    distance[..., 0] = torch.minimum(distance[..., 0], torch.where(real, d, math.inf).amin(-1))
    distance[..., 1] = torch.maximum(distance[..., 1], torch.where(real, d, -math.inf).amax(-1))
    threshold = gamma * distance[..., 0] + (1 - gamma) * distance[..., 1]  # [B, Hkv]
    return real & (d >= threshold[..., None])


def _to_side(store: dict, keep: Tensor, originals: Tensor, start: int, cap: Tensor) -> None:
    """Retained tokens (``keep`` ``[B, Hkv, S]``) into the next free side slots of their row
    and head, ``originals`` ``[B, Hkv, S, 4, D]``; past the row's ``cap`` ``[B or 1, 1, 1]``
    (or the buffer) they stay merged."""
    side, at = store["side"], store["side_at"]
    slot = store["retained"][..., None] + keep.long().cumsum(-1) - 1  # [B, Hkv, S]
    fits = keep & (slot < side.shape[2]) & (slot < cap)
    store["overflow"] += (keep & ~fits).sum(-1)
    store["retained"] += fits.sum(-1)
    b, h, j = fits.nonzero(as_tuple=True)
    side[b, h, slot[b, h, j]] = originals[b, h, j].to(side.dtype)  # [n, 4, D]
    at[b, h, slot[b, h, j]] = start + j


def restore(cache: KVCache, spec: CacheSpec, end: int) -> tuple[Tensor, Tensor]:
    """K and V ``[B, Hkv, end, D]`` of one layer of a pair: the stored directions times the
    layer's magnitudes, with its retained tokens' own K and V written back."""
    store, j = cache.merged[spec.id], 2 if spec.second else 0
    magnitude = store["magnitude"][:, :, :end]  # [B, Hkv, end, 4]
    keys = cache.k[spec.id][:, :, :end] * magnitude[..., j, None]
    values = cache.v[spec.id][:, :, :end] * magnitude[..., j + 1, None]
    at = store["side_at"]  # [B, Hkv, C]
    b, h, slot = ((at >= 0) & (at < end)).nonzero(as_tuple=True)
    keys[b, h, at[b, h, slot]] = store["side"][b, h, slot, j]
    values[b, h, at[b, h, slot]] = store["side"][b, h, slot, j + 1]
    return keys, values
