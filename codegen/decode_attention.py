"""Decode attention over the KV cache, split along the cache (flash-decoding).

One new token per sequence attends to the cache of a layer (or of another layer: the
caller passes whichever cache tensors it wants read, which is all KV sharing needs).
Parameters the sparse-attention passes need are built in:

- ``start[b]``: the first real cache position of row ``b`` (left padding before it);
- ``window`` and ``sinks``: see only the last ``window`` positions plus the first
  ``sinks`` real ones (StreamingLLM); ``window=0`` sees everything;
- ``index[b, h, :]``: per KV head, the list of cache positions to attend (top-k token
  selection, retrieval heads); ``-1`` pads a short list.

Reference: ``decode_attention_reference`` below (dense mask + softmax). Bytes: every
visible K and V row once, ``2 * n * D * itemsize`` per KV head; query heads of a GQA
group share those reads (one program serves the whole group, padded to 16 rows, a tensor-core
tile, so the scores and the weighted sum are ``tl.dot``s: a broadcast product ``[G, N, D]`` spilled
registers on sm_90 at G=8, D=64, see ``benchmarks/triton_kernels.py --aot``). Stage 1 gives each
(row, KV head, split) a partial softmax (output and log-sum-exp); stage 2 combines them.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import interpreted
from .online_softmax import online_softmax_step
from .rope import rope_operands, rope_rows


@triton.jit
def decode_attention_split_kernel(
        q_ptr, q2_ptr, k_ptr, v_ptr, start_ptr, index_ptr, part_ptr, lse_ptr, end_ptr, cos_ptr,
        sin_ptr, end, n_cand, chunk, scale, window, sinks, n_sink, group, head_dim, half,
        q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, i_sb, i_sh,
        p_sb, p_sh, p_ss, l_sb, l_sh, cs_sb,
        HAS_INDEX: tl.constexpr, END_FROM_PTR: tl.constexpr, HAS_ROPE: tl.constexpr,
        HAS_SINK_Q: tl.constexpr,
        DOT_F32: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    if END_FROM_PTR:  # a device value: the same launch serves every step of a CUDA graph
        end = tl.load(end_ptr)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask, dmask = g < group, d < head_dim
    heads = kvh * group + g  # the query heads of this KV head
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G, D]
    if HAS_ROPE:  # FuseRoPE: q is rotated here, not by a launch of its own
        q = rope_rows(q, q_ptr + b * q_sb + heads[:, None] * q_sh, gmask[:, None], cos_ptr,
                      sin_ptr, (b * cs_sb + 0 * heads)[:, None], d, half)
    if DOT_F32:
        q = q.to(tl.float32)
    if HAS_SINK_Q:  # a ring's sinks are scored by their own query (StreamingLLM positions)
        q2 = tl.load(q2_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                     mask=gmask[:, None] & dmask[None, :], other=0.0)  # [G, D]
        if DOT_F32:
            q2 = q2.to(tl.float32)
    first = tl.load(start_ptr + b)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_cand)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        inside = t < hi
        if HAS_INDEX:
            pos = tl.load(index_ptr + b * i_sb + kvh * i_sh + t, mask=inside, other=-1)
        else:
            pos = t
        valid = inside & (pos >= first) & (pos < end)
        if window > 0:  # the last `window` positions, plus the first `sinks` real ones
            valid = valid & ((end - 1 - pos < window) | (pos < first + sinks))
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + b * k_sb + kvh * k_sh + pos[:, None] * k_sl + d[None, :],
                    mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_ptr + b * v_sb + kvh * v_sh + pos[:, None] * v_sl + d[None, :],
                    mask=kv_mask, other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
        if HAS_SINK_Q:
            # the blocks that hold a sink (a ring's first slots): a second product there only
            if tl.min(tl.where(valid, pos, n_sink), axis=0) < n_sink:
                s2 = tl.dot(q2, tl.trans(k), input_precision="ieee") * scale
                s = tl.where((pos < n_sink)[None, :], s2, s)
        s = tl.where(valid[None, :], s, float("-inf"))
        m, lsum, acc = online_softmax_step(s, v, m, lsum, acc)
    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    lse = tl.where(lsum > 0, m + tl.log(tl.where(lsum > 0, lsum, 1.0)), float("-inf"))
    tl.store(part_ptr + b * p_sb + heads[:, None] * p_sh + split * p_ss + d[None, :], out,
             mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * l_sb + heads * l_sh + split, lse, mask=gmask)


@triton.jit
def decode_attention_combine_kernel(part_ptr, lse_ptr, out_ptr, splits, head_dim,
                                    p_sb, p_sh, p_ss, l_sb, l_sh, o_sb, o_sh,
                                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask, dmask = s < splits, d < head_dim
    lse = tl.load(lse_ptr + b * l_sb + h * l_sh + s, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))  # [S]
    part = tl.load(part_ptr + b * p_sb + h * p_sh + s[:, None] * p_ss + d[None, :],
                   mask=smask[:, None] & dmask[None, :], other=0.0)  # [S, D]
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * o_sb + h * o_sh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     end: int | torch.Tensor,
                     scale: float, start: Optional[torch.Tensor] = None, window: int = 0,
                     sinks: int = 0, index: Optional[torch.Tensor] = None,
                     splits: Optional[int] = None, block_n: int = 32,
                     out: Optional[torch.Tensor] = None, cos: Optional[torch.Tensor] = None,
                     sin: Optional[torch.Tensor] = None, q_sink: Optional[torch.Tensor] = None,
                     sink_slots: int = 0) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, D]`` over cache positions ``[0, end)`` of
    ``k_cache``/``v_cache`` ``[B, Hkv, L, D]`` -> ``[B, Hq, D]``. ``end`` may be a
    one-element device tensor (read by the kernel; the work then spans the whole cache).
    With ``cos``/``sin`` ``[B, 1, R]``, q is first rotated as ``rw.rope`` does. With
    ``q_sink`` (shaped like ``q``), positions below ``sink_slots`` are scored by it
    instead: a sink + window ring whose sinks sit at StreamingLLM's positions
    (``runtime.ring_cache``)."""
    b, hq, dim = q.shape
    hkv = k_cache.shape[1]
    end_ptr = end if isinstance(end, torch.Tensor) else None
    if end_ptr is not None:
        end = k_cache.shape[2]  # the loop bound; the kernel masks past the stored end
    if hq % hkv or k_cache.shape[-1] != dim or not 0 < end <= k_cache.shape[2]:
        raise ValueError(f"decode_attention: q {list(q.shape)}, cache {list(k_cache.shape)}, "
                         f"end {end} do not fit")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode_attention: block_n={block_n}; it must be a power of two >= 16 "
                         "(the p @ v product is a tl.dot over it)")
    if q_sink is not None and (q_sink.shape != q.shape or q_sink.stride() != q.stride()
                               or q_sink.dtype != q.dtype or q_sink.device != q.device
                               or cos is not None):
        raise ValueError(f"decode_attention: q_sink {list(q_sink.shape)} {q_sink.dtype} must be "
                         f"laid out like q {list(q.shape)} {q.dtype}, on its device, already "
                         f"rotated (no cos/sin)")
    if (q_sink is None) != (sink_slots == 0) or not 0 <= sink_slots <= k_cache.shape[2]:
        raise ValueError(f"decode_attention: sink_slots={sink_slots} needs a q_sink and must lie "
                         f"in [1, {k_cache.shape[2]}] (0 without one)")
    if start is None:
        start = torch.zeros(b, dtype=torch.int32, device=q.device)
    n_cand = index.shape[-1] if index is not None else end
    if splits is None:  # enough programs to fill a GPU, each with a few blocks of work
        splits = max(1, min(32, triton.cdiv(n_cand, 4 * block_n)))
    chunk = triton.cdiv(triton.cdiv(n_cand, splits), block_n) * block_n
    splits = triton.cdiv(n_cand, chunk)
    part = torch.empty(b, hq, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    idx = index if index is not None else start  # any int tensor: unused without HAS_INDEX
    cos2, sin2, half = rope_operands(cos, sin, b, 1, dim, q, "decode_attention")  # [B, R]
    decode_attention_split_kernel[(b, hkv, splits)](
        q, q if q_sink is None else q_sink, k_cache, v_cache, start, idx, part, lse,
        end_ptr if end_ptr is not None else start, cos2, sin2, end, n_cand, chunk, scale,
        window, sinks, sink_slots,
        hq // hkv, dim, half, q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        idx.stride(0), idx.stride(1) if index is not None else 0,
        *part.stride()[:3], *lse.stride()[:2], cos2.stride(0),
        HAS_INDEX=index is not None, END_FROM_PTR=end_ptr is not None, HAS_ROPE=cos is not None,
        HAS_SINK_Q=q_sink is not None,
        DOT_F32=interpreted(),
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)),  # a tensor-core tile's rows
        BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(dim)))  # tl.dot's least K
    if out is None:
        out = torch.empty(b, hq, dim, dtype=q.dtype, device=q.device)
    decode_attention_combine_kernel[(b, hq)](
        part, lse, out, splits, dim, *part.stride()[:3], *lse.stride()[:2], out.stride(0),
        out.stride(1), BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(dim))
    return out


def decode_attention_reference(q, k_cache, v_cache, end, scale, start=None, window=0, sinks=0,
                               index=None, q_sink=None, sink_slots=0):
    """The same attention with a dense mask, in float32 torch."""
    b, hq, dim = q.shape
    hkv = k_cache.shape[1]
    pos = torch.arange(end, device=q.device)
    first = start if start is not None else torch.zeros(b, dtype=torch.long, device=q.device)
    visible = (pos[None, :] >= first[:, None])[:, None, :].expand(b, hkv, end)  # [B, Hkv, end]
    if window > 0:
        near = (end - 1 - pos < window)[None, None, :]
        sink = (pos[None, :] < first[:, None] + sinks)[:, None, :]
        visible = visible & (near | sink)
    if index is not None:
        chosen = torch.zeros(b, hkv, end + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(index < 0, end, index).long(), True)  # -1 -> dropped slot
        visible = visible & chosen[:, :, :end]
    group = hq // hkv
    k = k_cache[:, :, :end].float().repeat_interleave(group, 1)  # [B, Hq, end, D]
    v = v_cache[:, :, :end].float().repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    if q_sink is not None:  # positions below sink_slots scored by the sink query
        sink_scores = torch.einsum("bhd,bhtd->bht", q_sink.float(), k) * scale
        scores = torch.where(pos < sink_slots, sink_scores, scores)
    scores = scores.masked_fill(~visible.repeat_interleave(group, 1), float("-inf"))
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v).to(q.dtype)
