"""Fused projections in checkpoints, split back into the linears the passes know.

Phi-3 stores q, k and v as one ``qkv_proj`` (rows ``[all q | all k | all v]``, with GQA
sizes: ``H * D`` rows of q, ``KV * D`` each of k and v) and its MLP's gate and up as one
``gate_up_proj`` (rows ``[gate | up]``, chunked in two). The lifter splits both into
separate ``rw.linear`` ops, the form Llama's checkpoints have, so FuseQKV, FuseSwiGLU,
TensorParallel and Int4Weights apply to them unchanged (FuseQKV fuses them again, in the
layout its kernels expect). Only the layouts read here are split; any other is reported.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

aten = torch.ops.aten


def last_dim_slices(fused: fx.Node) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each user of ``fused`` that slices its last dimension (a
    ``[B, S, F]`` value), sorted, or None when any user does something else."""
    found = []
    for u in fused.users:
        if u.target != aten.slice.Tensor or u.args[0] is not fused or len(u.args) < 4 \
                or u.args[1] not in (2, -1) or (len(u.args) > 4 and u.args[4] != 1):
            return None
        start, end = u.args[2], u.args[3]
        if not isinstance(start, int) or not isinstance(end, int):
            return None
        found.append((start, end))
    return sorted(found)


def qkv_proj_rows(fused: fx.Node, out_features: int, heads: int, kv_heads: int,
                  head_dim: int) -> tuple[torch.Tensor, ...] | None:
    """Row indices of q, k and v in Phi-3's ``qkv_proj`` weight, checked against the
    slices the attention takes of its output, or None if they are not those."""
    q, kv = heads * head_dim, kv_heads * head_dim
    if q + 2 * kv != out_features:
        return None
    bounds = [(0, q), (q, q + kv), (q + kv, out_features)]
    slices = last_dim_slices(fused)
    if slices is None or len(slices) != 3:
        return None
    for (start, end), (want_start, want_end) in zip(slices, bounds):
        if start != want_start or min(end, out_features) != want_end:
            return None
    return tuple(torch.arange(a, b) for a, b in bounds)


def gate_up_halves(fused: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(gate getitem, up getitem)`` when ``fused``'s only use is ``chunk(2, -1)`` read
    as its two halves (Phi-3's ``gate, up = gate_up_proj(x).chunk(2, dim=-1)``)."""
    users = list(fused.users)
    if len(users) != 1:
        return None
    (chunk,) = users
    if chunk.target != aten.chunk.default or tuple(chunk.args[1:]) not in ((2, -1), (2, 2)):
        return None
    items = {u.args[1]: u for u in chunk.users if u.target is operator.getitem}
    if len(items) != len(chunk.users) or set(items) != {0, 1}:
        return None
    return items[0], items[1]
