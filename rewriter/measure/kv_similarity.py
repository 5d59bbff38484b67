"""How alike the layers' keys and values are: the premise of sharing one layer's KV cache
with another (``ShareKV``) or merging them (MiniCache).

``layer_kv`` runs an IR's whole-sequence graph over a text and keeps every attention op's
keys (rotated, as the cache holds them) and values. ``similarity`` compares every pair of
layers token by token: the cosine of layer i's and layer j's key (value) for the same token
and KV head, averaged over tokens, heads and rows. 1 means the two layers cache the same
directions (MiniCache merges directions and keeps each layer's magnitudes); near 0, a
reader of the other's cache would attend with keys unrelated to its own. ``distance`` is
KVSharer's criterion instead: the Euclidean distance between the two layers' caches
averaged over the text (KVSharer shares the most dissimilar pairs first).
"""
from __future__ import annotations

import torch
from torch import Tensor, fx

from rewriter.measure.calibrate import sequence_inputs
from rewriter.ops import OPS, REFERENCE, op_arguments


class _Recorder(fx.Interpreter):
    """Runs the whole-sequence graph, keeping each attention's K and V ``[B, T, Hkv, D]``
    (float32, on the host) by layer."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}

    def call_function(self, target, args, kwargs):
        if target is OPS["attention"]:
            a = op_arguments("attention", tuple(args), dict(kwargs))
            k = a["k"]
            if a["cos"] is not None:  # FuseRoPE: the cache holds k rotated
                k = REFERENCE["rope"](k, a["cos"], a["sin"], a["head_dim"])
            b, t, _ = k.shape
            shape = (b, t, a["num_kv_heads"], a["head_dim"])  # [B, T, Hkv, D]
            self.kv[a["layer"]] = (k.float().reshape(shape).cpu(),
                                   a["v"].float().reshape(shape).cpu())
        return super().call_function(target, args, kwargs)


def layer_kv(ir, ids: Tensor) -> dict[int, tuple[Tensor, Tensor]]:
    """``{layer: (K, V)}``, each ``[B, T, Hkv, D]``, of ``ids`` ``[B, T]`` (no padding)."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"layer_kv: ids must be a [B, T] tensor, got {getattr(ids, 'shape', ids)!r}")
    recorder = _Recorder(ir.gm)
    with torch.inference_mode():
        recorder.run(*sequence_inputs(ir, ids))
    if not recorder.kv:
        raise ValueError("layer_kv: the IR has no rw.attention")
    return dict(sorted(recorder.kv.items()))


def similarity(kv: dict[int, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """``(keys, values)``, each ``[L, L]`` over the layers of ``kv`` in order: the mean
    per-token, per-head cosine of two layers' vectors (NaN where their shapes differ)."""
    units = [tuple(torch.nn.functional.normalize(x, dim=-1) for x in pair) for pair in kv.values()]
    n = len(units)
    out = torch.full((2, n, n), float("nan"))
    for i in range(n):
        for j in range(n):
            for part in range(2):
                a, b = units[i][part], units[j][part]
                if a.shape == b.shape:
                    out[part, i, j] = (a * b).sum(-1).mean()
    return out[0], out[1]


def distance(kv: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
    """``[L, L]``: KVSharer's distance, between two layers' K and V averaged over the text
    (each flattened over heads and head size; NaN where their shapes differ)."""
    means = [torch.cat([k.mean((0, 1)).flatten(), v.mean((0, 1)).flatten()]) for k, v in kv.values()]
    n = len(means)
    out = torch.full((n, n), float("nan"))
    for i in range(n):
        for j in range(n):
            if means[i].shape == means[j].shape:
                out[i, j] = (means[i] - means[j]).norm()
    return out
