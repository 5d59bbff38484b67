"""Prefill attention: a block of new tokens attends causally to the KV cache (flash style).

Queries are the ``S`` tokens at cache positions ``[q_start, q_start + S)`` with heads folded
(``[B, S, Hq*D]``, the IR's layout); keys and values are cache positions ``[0, q_start + S)``
of ``[B, Hkv, L, D]`` tensors, already written. ``q_start`` is an int, or a ``[B]`` device
tensor when each row has its own length (speculative rounds after ragged acceptance, and
the static rounds a CUDA graph replays): the kernel reads it, the host never does.
Query ``i`` sees key ``j`` when ``j <= i``, ``j`` is a real token of its row (``j >=
start[b]``; a padding query sees itself only, so no row is empty), and, with ``window > 0``, ``i - j < window`` or ``j`` is one of the first
``sinks`` real tokens. With ``tree`` (int64 ``[S]``: bit ``j`` of ``tree[i]`` set when query
``i`` may see the step's own token ``j``; a token tree verified at once, at most 64 nodes)
the step's tokens see only their ancestors and themselves instead of every earlier one.
Reference: ``rw.attention`` (``rewriter.ops``) for ``q_start = 0``; ``Step._tree_mask``.
Bytes: Q and O once, K and V once per query block (``S / BLOCK_M`` times).
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
def prefill_attention_kernel(
        q_ptr, k_ptr, v_ptr, start_ptr, out_ptr, cos_ptr, sin_ptr, tree_ptr, qstart_ptr,
        seq, q_start, scale, window, sinks, n_heads, group, head_dim, half,
        q_sb, q_ss, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, o_sb, o_ss, cs_ss,
        HAS_ROPE: tl.constexpr, HAS_TREE: tl.constexpr, QSTART_PER_ROW: tl.constexpr,
        DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    mblock = tl.program_id(0)
    b = tl.program_id(1) // n_heads
    h = tl.program_id(1) % n_heads
    kvh = h // group
    if QSTART_PER_ROW:  # this row's first query position, read on the device
        q_start = tl.load(qstart_ptr + b)
    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the step
    d = tl.arange(0, BLOCK_D)
    rmask, dmask = rows < seq, d < head_dim
    qi = q_start + rows  # query cache positions
    q = tl.load(q_ptr + b * q_sb + rows[:, None] * q_ss + h * head_dim + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if HAS_ROPE:  # FuseRoPE: q is rotated here, not by a launch of its own
        q = rope_rows(q, q_ptr + b * q_sb + rows[:, None] * q_ss + h * head_dim, rmask[:, None],
                      cos_ptr, sin_ptr, (b * seq + rows)[:, None] * cs_ss, d, half)
    if DOT_F32:
        q = q.to(tl.float32)
    first = tl.load(start_ptr + b)
    if HAS_TREE:
        ancestors = tl.load(tree_ptr + rows, mask=rmask, other=0)  # [M] int64 bit sets
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(q_start + (mblock + 1) * BLOCK_M, q_start + seq)  # causal: no later keys
    for n0 in range(0, hi, BLOCK_N):
        kj = n0 + tl.arange(0, BLOCK_N)
        kmask = kj < hi
        k = tl.load(k_ptr + b * k_sb + kvh * k_sh + kj[:, None] * k_sl + d[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(v_ptr + b * v_sb + kvh * v_sh + kj[:, None] * v_sl + d[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, N]
        ok = (kj[None, :] <= qi[:, None]) & kmask[None, :]
        ok = ok & ((kj[None, :] >= first) | (kj[None, :] == qi[:, None]))
        if window > 0:
            ok = ok & ((qi[:, None] - kj[None, :] < window) | (kj[None, :] < first + sinks))
        if HAS_TREE:  # the step's own keys: ancestors and self only
            rel = kj - q_start
            # shifts stay in [0, 63]: a shift past the width is undefined on a GPU (keys past
            # the step are masked by causality anyway)
            shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
            bit = (ancestors[:, None] >> shift[None, :]) & 1
            ok = ok & ((rel[None, :] < 0) | (bit != 0))
        s = tl.where(ok, s, float("-inf"))
        m, lsum, acc = online_softmax_step(s, v, m, lsum, acc)
    out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
    tl.store(out_ptr + b * o_sb + rows[:, None] * o_ss + h * head_dim + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      num_heads: int, scale: float, q_start=0,
                      start: Optional[torch.Tensor] = None, window: int = 0, sinks: int = 0,
                      out: Optional[torch.Tensor] = None, block: Optional[int] = None,
                      cos: Optional[torch.Tensor] = None,
                      sin: Optional[torch.Tensor] = None,
                      tree: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q`` ``[B, S, Hq*D]`` over cache ``[B, Hkv, L, D]`` positions ``[0, q_start + S)``
    -> ``[B, S, Hq*D]``; ``q_start`` an int or each row's, ``[B]`` on q's device.
    ``block``: query and key tile (64 on a GPU; 16 under the interpreter, where small tiles
    keep several blocks, and their masks, in small tests).
    With ``cos``/``sin`` ``[B, S, R]``, q is first rotated as ``rw.rope`` does; ``tree``
    (``tree_bits``) replaces the causal order among the step's own tokens."""
    b, s, hd = q.shape
    dim = hd // num_heads
    hkv = k_cache.shape[1]
    per_row = isinstance(q_start, torch.Tensor)
    if per_row and (q_start.shape != (b,) or q_start.dtype not in (torch.int32, torch.int64)
                    or q_start.device != q.device or (b > 1 and q_start.stride(0) != 1)):
        raise ValueError(f"prefill_attention: a per-row q_start must be a contiguous int tensor "
                         f"[{b}] on {q.device}, got {q_start.dtype} {list(q_start.shape)} "
                         f"(strides {list(q_start.stride())}) on {q_start.device}")
    # a per-row start is never read here (under CUDA-graph capture that would sync): the
    # caller keeps each row's q_start + S within the cache, as the runtime's steps do
    if num_heads % hkv or k_cache.shape[-1] != dim or \
            (not per_row and q_start + s > k_cache.shape[2]) or s > k_cache.shape[2]:
        raise ValueError(f"prefill_attention: q {list(q.shape)} ({num_heads} heads), cache "
                         f"{list(k_cache.shape)}, q_start {'per row' if per_row else q_start} "
                         f"do not fit")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if start is None:
        start = torch.zeros(b, dtype=torch.int32, device=q.device)
    if tree is not None and (tree.shape != (s,) or tree.dtype != torch.int64 or s > 64):
        raise ValueError(f"prefill_attention: tree must be int64 [{s}] (at most 64 tokens), "
                         f"got {tree.dtype} {list(tree.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if block is None:
        block = 16 if interpreted() else 64
    grid = (triton.cdiv(s, block), b * num_heads)
    cos2, sin2, half = rope_operands(cos, sin, b, s, dim, q, "prefill_attention")  # [B*S, R]
    block_d = max(16, triton.next_power_of_2(dim))
    # A 64x128 fp32 accumulator on 4 warps is 64 registers a thread before the tiles: sm_80
    # hit its 255-register ceiling there (benchmarks/triton_kernels.py --aot 80), so 8 warps.
    warps = 8 if block >= 64 and block_d >= 128 else 4
    prefill_attention_kernel[grid](
        q, k_cache, v_cache, start, out, cos2, sin2, tree if tree is not None else start,
        q_start if per_row else start, s, 0 if per_row else q_start, scale, window, sinks, num_heads,
        num_heads // hkv, dim, half, q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], out.stride(0), out.stride(1), cos2.stride(0),
        HAS_ROPE=cos is not None, HAS_TREE=tree is not None, QSTART_PER_ROW=per_row,
        DOT_F32=interpreted(), BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, num_warps=warps)
    return out


def tree_bits(ancestors: torch.Tensor) -> torch.Tensor:
    """``[S, S]`` bool (query i may see token j) -> int64 ``[S]`` with bit j of row i set."""
    s = ancestors.shape[0]
    weights = torch.ones(s, dtype=torch.int64, device=ancestors.device) << torch.arange(
        s, device=ancestors.device)
    return (ancestors.to(torch.int64) * weights).sum(-1)
