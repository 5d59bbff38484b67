"""How much of each layer's attention a TidalDecode selection keeps, measured on the model.

TidalDecode rests on one assumption: the tokens one layer attends to most are the ones the
next layers attend to ("tidal" attention). Whether a model honours it, and from which
layers, can be measured without a GPU and without decoding: run the IR densely over a
text, take the softmax rows of its last queries in every layer, make each layer's
selection for those queries (its query group's top-k, as ``rw.select_tokens`` makes it,
plus the ``recent`` window and the query itself) and sum, for every later layer and query
head, the dense attention weight that falls inside it. A kept mass of 1 means the sparse
layer sees everything it would have attended to; what is lost is renormalised away over
the selected tokens, so a low mass is a wrong output, not a small one.

``kept_mass`` gives that matrix (selection layer x reading layer); ``best_selection_layers``
chooses the selection layers that keep the most attention within a budget of KV bytes
read per decode step, TidalDecode's cost model: layers up to and including the first
selection layer, and every selection layer, read the whole cache; the others read
``top_k + recent + 1`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx

from rewriter.ops import OPS, REFERENCE, op_arguments


class _Recorder(fx.Interpreter):
    """Runs an IR's whole-sequence graph and keeps, per ``rw.attention``, the softmax rows
    of its last ``queries`` positions over every key: ``rows[layer]`` ``[B, Hq, queries,
    T]`` (causal, no padding), exactly the weights the op applies."""

    def __init__(self, gm: fx.GraphModule, queries: int):
        super().__init__(gm)
        self.queries, self.rows = queries, {}

    def call_function(self, target, args, kwargs):
        if target is OPS["attention"]:
            a = op_arguments("attention", tuple(args), dict(kwargs))
            if any(a[name] is not None for name in ("window", "sinks", "select", "full_heads")) \
                    or not a["causal"]:
                raise ValueError(f"attention_rows: layer {a['layer']}'s attention is not plain "
                                 f"causal attention over every key (a window, sinks, a "
                                 f"selection or a head split): measure the model before such passes")
            self.rows[a["layer"]] = _rows(a, self.queries)
        return super().call_function(target, args, kwargs)


def _rows(a: dict, queries: int) -> Tensor:
    q, k = a["q"], a["k"]
    if a["cos"] is not None:  # FuseRoPE: rotated inside the op
        q = REFERENCE["rope"](q, a["cos"], a["sin"], a["head_dim"])
        k = REFERENCE["rope"](k, a["cos"], a["sin"], a["head_dim"])
    b, t, _ = q.shape
    hq, hkv, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    qh = q[:, -queries:].float().reshape(b, queries, hq, d).transpose(1, 2)  # [B, Hq, Q, D]
    kh = k.float().reshape(b, t, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)  # [B, Hq, T, D]
    scores = qh @ kh.transpose(-1, -2) * a["scale"]  # [B, Hq, Q, T]
    later = torch.arange(t)[None, :] > torch.arange(t - queries, t)[:, None]  # [Q, T]
    return scores.masked_fill(later.to(scores.device), float("-inf")).softmax(-1).cpu()


def attention_rows(ir, ids: Tensor, queries: int) -> List[Tensor]:
    """Per attention layer (by cache id), ``[B, Hq, queries, T]``: the dense softmax rows of
    the last ``queries`` positions of ``ids`` ``[B, T]`` (no padding), from the IR's
    whole-sequence graph (``rewriter.optimize(model).ir``, before sparse passes)."""
    if ids.dim() != 2 or not 1 <= queries < ids.shape[1]:
        raise ValueError(f"attention_rows: ids must be [B, T] with T > queries >= 1, got "
                         f"{tuple(ids.shape)} and queries={queries}")
    weight = max((t for t in ir.weights().values() if t.is_floating_point()),
                 key=torch.Tensor.numel, default=None)
    ids = ids.to(weight.device) if weight is not None else ids
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    recorder = _Recorder(ir.gm, queries)
    with torch.inference_mode():
        recorder.run(ids, positions)
    layers = sorted(recorder.rows)
    if not layers:
        raise ValueError("attention_rows: the IR has no rw.attention")
    return [recorder.rows[i] for i in layers]


def kv_heads(ir) -> int:
    """The KV heads of the IR's attention layers (one number: TidalDecode selects per KV
    head, and every layer's selection must fit every other's)."""
    found = {op_arguments("attention", tuple(n.args), dict(n.kwargs))["num_kv_heads"]
             for n in ir.graph.find_nodes(op="call_function", target=OPS["attention"])}
    if len(found) != 1:
        raise ValueError(f"kv_heads: the IR's attention layers have KV heads {sorted(found)}; "
                         f"one number is needed")
    return found.pop()


def selections(rows: Tensor, num_kv_heads: int, top_k: int, recent: int) -> Tensor:
    """``[B, Hkv, Q, T]`` booleans: what a selection layer with softmax rows ``rows`` ``[B,
    Hq, Q, T]`` gives each KV head's query group, as ``rw.select_tokens`` chooses it: the
    ``top_k`` keys before the ``recent`` window by summed group weight (the weights taken
    over those keys only), then the window and the query itself."""
    b, hq, q, t = rows.shape
    pos = torch.arange(t - q, t)[:, None]  # [Q, 1]: each query's own position
    key = torch.arange(t)[None, :]  # [1, T]
    allowed = key < pos - recent  # [Q, T]
    w = rows.masked_fill(~allowed, 0.0)
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-30)  # softmax over the allowed keys only
    w = w.view(b, num_kv_heads, hq // num_kv_heads, q, t).sum(2)  # [B, Hkv, Q, T]
    k = min(top_k, t)
    best, idx = w.masked_fill(~allowed, -1.0).topk(k, dim=-1)
    chosen = torch.zeros(b, num_kv_heads, q, t, dtype=torch.bool)
    chosen.scatter_(-1, idx, best >= 0)  # -1: fewer allowed keys than top_k
    return chosen | ((key >= pos - recent) & (key <= pos))


def kept_mass(rows: Sequence[Tensor], num_kv_heads: int, top_k: int, recent: int) -> Tensor:
    """``[L, L]``: entry ``[s, l]`` (``l >= s``; 0 below the diagonal) is the dense
    attention weight layer ``l``'s query heads put on what selection layer ``s`` selects,
    averaged over heads, queries and rows. ``[l, l]`` is a layer's own top-k: the most any
    selection of that size keeps for it."""
    n = len(rows)
    out = torch.zeros(n, n)
    for s in range(n):
        chosen = selections(rows[s], num_kv_heads, top_k, recent)  # [B, Hkv, Q, T]
        for l in range(s, n):
            b, hq, q, t = rows[l].shape
            heads = chosen.repeat_interleave(hq // num_kv_heads, dim=1)  # [B, Hq, Q, T]
            out[s, l] = (rows[l] * heads).sum(-1).mean()
    return out


@dataclass
class Choice:
    selection_layers: List[int]
    bytes_read: float  # a decode step's KV bytes, as a fraction of dense attention's
    kept: float  # mean over layers of the attention weight kept (dense layers keep 1)


def best_selection_layers(kept: Tensor, tokens: int, top_k: int, recent: int,
                          budget: float, most: Optional[int] = None) -> Optional[Choice]:
    """The selection layers that keep the most attention, summed over layers, with a decode
    step reading at most ``budget`` of dense attention's KV bytes at ``tokens`` cached (a
    fraction: 0.25 for 4x fewer); None if nothing fits. Layers before the first selection
    layer and the selection layers themselves read everything (TidalDecode's), every other
    layer ``top_k + recent + 1`` tokens, with the kept mass ``kept[s, l]`` of the latest
    selection layer ``s`` before it. ``most`` bounds the number of selection layers."""
    n = kept.shape[0]
    sparse = min(1.0, (top_k + recent + 1) / tokens)
    best: Optional[Choice] = None
    for count in range(1, (most or n) + 1):  # fewer selection layers first: ties keep them
        for first in range(n - 1):
            dense = first + count  # layers reading the whole cache
            if dense >= n or (dense + (n - dense) * sparse) / n > budget + 1e-12:
                continue
            score, layers = _best_after(kept, first, count)
            if score < 0:  # not that many layers after the first selection
                continue
            total = (first + 1 + score) / n  # dense layers up to the first selection keep 1
            if best is None or total > best.kept + 1e-12:
                best = Choice(layers, (dense + (n - dense) * sparse) / n, total)
    return best


def _best_after(kept: Tensor, first: int, count: int) -> Tuple[float, List[int]]:
    """The ``count - 1`` selection layers after ``first`` that maximise the mass kept by
    layers ``first + 1 ..`` (a selection layer keeps 1), and that mass: a dynamic programme
    over (latest selection layer, selections so far)."""
    n = kept.shape[0]

    def run(s: int, end: int) -> float:  # mass kept by layers s+1 .. end-1 reading s's selection
        return float(kept[s, s + 1:end].sum())

    # best[(j, c)]: (mass of layers first+1 .. j, layers) with j the c-th selection layer
    best = {(first, 1): (0.0, [first])}
    for c in range(1, count):
        for (j, used), (score, layers) in list(best.items()):
            if used != c:
                continue
            for nxt in range(j + 1, n - 1):  # the last layer never selects: nothing reads it
                cand = (score + run(j, nxt) + 1.0, layers + [nxt])
                if cand[0] > best.get((nxt, c + 1), (-1.0, None))[0]:
                    best[(nxt, c + 1)] = cand
    ends = [(score + run(j, n), layers) for (j, used), (score, layers) in best.items() if used == count]
    return max(ends, key=lambda e: e[0]) if ends else (-1.0, [first])
