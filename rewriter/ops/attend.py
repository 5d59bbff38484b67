"""The attention op and its masks: causal, sliding window, StreamingLLM sinks, a selection's
keys, DuoAttention's full heads."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rewriter.maths.mask import visible
from rewriter.ops.registry import REFERENCE, _dims, _need, _register
from rewriter.ops.positions import _rope_fake


def attention_mask(q_len: int, k_len: int, window: Optional[int], device,
                   sinks: Optional[int] = None) -> Tensor:
    """Boolean ``[q_len, k_len]``: query i (the last ``q_len`` of ``k_len``) sees key j:
    the last ``window`` keys, and with ``sinks`` the first ``sinks`` keys too (StreamingLLM)."""
    qi = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kj = torch.arange(k_len, device=device)[None, :]
    return visible(qi, kj, window, sinks)


def selected_mask(select: Tensor, keys: int) -> Tensor:
    """``[B, Hkv, S, keys]``: query i (the last S of ``keys``) sees the keys ``select``
    ``[B, Hkv, S, k]`` names (-1: none) and itself."""
    b, h, s, _ = select.shape
    mask = torch.zeros(b, h, s, keys + 1, dtype=torch.bool, device=select.device)
    mask.scatter_(-1, torch.where(select < 0, keys, select), True)  # -1 lands in the spare column
    mask = mask[..., :keys]
    own = torch.arange(keys - s, keys, device=select.device)  # [S]
    mask[..., torch.arange(s, device=select.device), own] = True
    return mask


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _attention_fake(q, k, v, layer, num_heads, num_kv_heads, head_dim, scale, causal=True,
                    window=None, cos=None, sin=None, sinks=None, rotary=None, select=None,
                    full_heads=None, gates=None, kv_source=None, merge_with=None, merge=None):
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    _need(q.dim() == 3 and q.shape[-1] == q_width, "attention",
          f"q {_dims(q)} is not [B, S, num_heads * head_dim = {q_width}]")
    for name, t in (("k", k), ("v", v)):
        _need(t.dim() == 3 and t.shape[-1] == kv_width and t.shape[:2] == q.shape[:2], "attention",
              f"{name} {_dims(t)} is not [B, S, num_kv_heads * head_dim = {kv_width}] like q {_dims(q)}")
    if cos is not None or sin is not None:
        _need(cos is not None and sin is not None, "attention", "cos and sin come together")
        _rope_fake(q, cos, sin, head_dim)
    return torch.empty_like(q)


@_register(fake=_attention_fake)
def attention(q: Tensor, k: Tensor, v: Tensor, layer: int, num_heads: int, num_kv_heads: int,
              head_dim: int, scale: float, causal: bool = True, window: Optional[int] = None,
              cos: Optional[Tensor] = None, sin: Optional[Tensor] = None,
              sinks: Optional[int] = None, rotary: Optional[Tensor] = None,
              select: Optional[Tensor] = None, full_heads: Optional[list[int]] = None,
              gates: Optional[list[float]] = None, kv_source: Optional[int] = None,
              merge_with: Optional[int] = None, merge: Optional[list[float]] = None) -> Tensor:
    """Scaled dot-product attention of one decoder layer; the op that owns the KV cache.

    q ``[B, S, Hq*D]``, k/v ``[B, S, Hkv*D]`` -> ``[B, S, Hq*D]``. Query heads are grouped
    over ``Hq / Hkv`` key/value heads (GQA). ``window`` limits each query to the last
    ``window`` keys (sliding-window attention); with ``sinks`` (``StreamingAttention``) also
    the sequence's first ``sinks`` keys, and the runtime keeps that layer's cache in a ring
    of ``sinks + window`` slots. With ``rotary`` (the model's RoPE frequencies) as well, the
    sinks sit at StreamingLLM's positions: just before the window, whatever the query's
    distance from them (``sink_attention``). With ``select`` (``[B, Hkv, S, top_k]`` from
    ``select_tokens``: TidalDecode) a query sees only the selected earlier keys and itself.
    With ``full_heads`` (``DuoAttention``) the sinks and window bind only the other KV heads:
    those listed attend to every earlier key, and the runtime keeps them in a full cache
    beside the others' ring. ``gates`` (one per KV head, ``DuoAttention``'s calibrated
    gates) changes nothing: it records why the heads were split, for the IR and artifacts.
    ``layer`` names the cache slot. ``kv_source`` (``ShareKV``) names another layer
    whose cache this one reads (k and v are then that layer's own inputs, so the reference
    computes what the runtime reads); the runtime writes nothing for it. ``merge_with``
    (``MiniCache``) names the adjacent layer whose cache this one's is merged with, and
    ``merge`` holds the pair's ``[t, gamma, retain]`` (``runtime.merged_cache``): the merge
    is a property of the runtime's cache, so this op still computes exact attention. With
    ``cos``/``sin`` (``FuseRoPE``), q and k are rotated first, exactly as ``rope`` does, so a
    backend can rotate K in the kernel that writes it into the cache.
    """
    if cos is not None:
        q = REFERENCE["rope"](q, cos, sin, head_dim)
        k = REFERENCE["rope"](k, cos, sin, head_dim)
    b, s, _ = q.shape
    qh, kh, vh = _grouped_heads(q, k, v, num_heads, num_kv_heads, head_dim)
    mask = _mask(s, kh.shape[2], causal, window, sinks, select, num_heads // num_kv_heads, q.device)
    if rotary is not None:
        out = _at_sink_positions(qh, kh, vh, mask, scale, sinks, window, rotary, head_dim)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    if full_heads is not None:
        out = _with_full_heads(out, qh, kh, vh, scale, full_heads, num_kv_heads)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)  # [B, S, Hq*D]


def _grouped_heads(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """q ``[B, S, Hq*D]``, k/v ``[B, T, Hkv*D]`` -> ``[B, Hq, S, D]``, ``[B, Hq, T, D]`` twice:
    each KV head repeated over its group of query heads (GQA)."""
    b, s, _ = q.shape
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, Hq, S, D]
    kh = k.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
    vh = v.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, T, D]
    groups = num_heads // num_kv_heads
    return qh, kh.repeat_interleave(groups, dim=1), vh.repeat_interleave(groups, dim=1)


def _mask(s: int, t: int, causal: bool, window: Optional[int], sinks: Optional[int],
          select: Optional[Tensor], groups: int, device) -> Optional[Tensor]:
    """What the last ``s`` of ``t`` keys' queries see: ``[S, T]`` (causal, window, sinks),
    ``[B, Hq, S, T]`` with a selection (which replaces the window), None for no mask."""
    mask = attention_mask(s, t, window, device, sinks) if causal else None
    if select is not None:
        mask = selected_mask(select, t).repeat_interleave(groups, dim=1)  # [B, Hq, S, T]
    return mask


def _at_sink_positions(qh: Tensor, kh: Tensor, vh: Tensor, mask: Tensor, scale: float,
                       sinks: int, window: int, inv_freq: Tensor, head_dim: int) -> Tensor:
    """``sink_attention`` for queries that are the last S of T keys: a query past the end of
    a full ring (``sinks + window``) is shifted back by how far past it is."""
    b, _, s, _ = qh.shape
    t = kh.shape[2]
    shift = (torch.arange(t - s, t, device=qh.device) - (sinks + window - 1)).clamp(min=0)
    is_sink = (torch.arange(t, device=qh.device) < sinks)[None, None, None]  # [1, 1, 1, T]
    return sink_attention(qh, kh, vh, mask, scale, is_sink, shift.expand(b, s), inv_freq, head_dim)


def _with_full_heads(out: Tensor, qh: Tensor, kh: Tensor, vh: Tensor, scale: float,
                     full_heads: list[int], num_kv_heads: int) -> Tensor:
    """DuoAttention: ``out`` ``[B, Hq, S, D]`` with the query groups of the KV heads in
    ``full_heads`` replaced by plain causal attention over every earlier key."""
    s, t, device = qh.shape[2], kh.shape[2], qh.device
    full = (torch.arange(num_kv_heads, device=device)[:, None]
            == torch.tensor(full_heads, device=device)).any(1)  # [Hkv]
    whole = F.scaled_dot_product_attention(
        qh, kh, vh, scale=scale, attn_mask=attention_mask(s, t, None, device))
    groups = qh.shape[1] // num_kv_heads
    return torch.where(full.repeat_interleave(groups)[None, :, None, None], whole, out)


def sink_attention(qh: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                   is_sink: Tensor, shift: Tensor, inv_freq: Tensor, head_dim: int) -> Tensor:
    """Attention with StreamingLLM's sink positions: qh ``[B, H, S, D]``, keys/values
    ``[B, H, K, D]`` (heads already matched), ``mask`` and ``is_sink`` boolean, broadcast to
    ``[B, H, S, K]``. Keys hold RoPE at their true positions; a query ``shift`` ``[B, S]``
    positions past the end of a full cache (``sinks + window``) scores the sinks as if they
    sat just before its window, i.e. with itself rotated back by ``shift``. Inside the
    window every distance is the true one, so only the sinks' columns change."""
    b, h, s, d = qh.shape
    scores = qh @ keys.transpose(-1, -2) * scale  # [B, H, S, K]
    cos, sin = REFERENCE["rotary"](shift, inv_freq, 1.0)  # [B, S, R]
    flat = qh.transpose(1, 2).reshape(b, s, h * d)  # [B, S, H*D]
    back = REFERENCE["rope"](flat, cos, -sin, head_dim).view(b, s, h, d).transpose(1, 2)
    scores = torch.where(is_sink, back @ keys.transpose(-1, -2) * scale, scores)
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    return probs @ values  # [B, H, S, D]
