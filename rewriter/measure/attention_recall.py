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

``kept_mass`` gives that matrix (selection layer x reading layer): the selections come from
the op's own ranking (``rewriter.ops.top_tokens``). ``best_selection_layers``
chooses the selection layers that keep the most attention within a budget of KV bytes
read per decode step, TidalDecode's cost model: layers up to and including the first
selection layer, and every selection layer, read the whole cache; the others read
``top_k + recent + 1`` tokens. With ``select_own`` (``TidalDecode(select_own=True)``) a
selection layer reads every key and its selection's values, and keeps its own top-k's
mass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, fx

from rewriter.measure.calibrate import sequence_inputs
from rewriter.ops import OPS, REFERENCE, op_arguments, top_tokens


@dataclass
class Recorded:
    """One attention layer over a text, for its last Q positions: ``weights`` ``[B, Hq, Q,
    T]`` the softmax it applies (causal, every key), ``q`` ``[B, Hq, Q, D]`` and ``k``
    ``[B, Hkv, T, D]`` its rotated queries and keys, from which a selection is ranked."""
    weights: Tensor
    q: Tensor
    k: Tensor


class _Recorder(fx.Interpreter):
    """Runs an IR's whole-sequence graph and keeps, per ``rw.attention`` (by cache id), what
    ``Recorded`` holds for the last ``queries`` positions."""

    def __init__(self, gm: fx.GraphModule, queries: int):
        super().__init__(gm)
        self.extra_traceback = False  # a refusal below is the whole message
        self.queries, self.layers = queries, {}

    def call_function(self, target, args, kwargs):
        if target is OPS["attention"]:
            a = op_arguments("attention", tuple(args), dict(kwargs))
            why = not_plain(a)
            if why:
                raise ValueError(f"attention_rows: layer {a['layer']}'s attention {why}: "
                                 f"measure the model before such passes")
            self.layers[a["layer"]] = _record(a, self.queries)
        return super().call_function(target, args, kwargs)


def not_plain(a: dict) -> Optional[str]:
    """Why attention arguments ``a`` are not causal attention over every key, or None."""
    for name in ("window", "sinks", "select", "full_heads"):
        if a[name] is not None:
            return f"has {name}={a[name] if name != 'select' else '...'}, not every key"
    return None if a["causal"] else "is not causal"


def _record(a: dict, queries: int) -> Recorded:
    q, k = a["q"], a["k"]
    if a["cos"] is not None:  # FuseRoPE: rotated inside the op
        q = REFERENCE["rope"](q, a["cos"], a["sin"], a["head_dim"])
        k = REFERENCE["rope"](k, a["cos"], a["sin"], a["head_dim"])
    b, t, _ = q.shape
    hq, hkv, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    qh = q[:, -queries:].float().reshape(b, queries, hq, d).transpose(1, 2)  # [B, Hq, Q, D]
    kh = k.float().reshape(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, T, D]
    scores = qh @ kh.repeat_interleave(hq // hkv, 1).transpose(-1, -2) * a["scale"]  # [B, Hq, Q, T]
    later = torch.arange(t)[None, :] > torch.arange(t - queries, t)[:, None]  # [Q, T]
    weights = scores.masked_fill(later.to(scores.device), float("-inf")).softmax(-1)
    return Recorded(weights.cpu(), qh.cpu(), kh.cpu())


def attention_rows(ir, ids: Tensor, queries: int) -> List[Recorded]:
    """Per attention layer (by cache id), what it does for the last ``queries`` positions
    of ``ids`` ``[B, T]`` (no padding), from the IR's whole-sequence graph
    (``rewriter.optimize(model).ir``, before sparse passes)."""
    if ids.dim() != 2 or not 1 <= queries < ids.shape[1]:
        raise ValueError(f"attention_rows: ids must be [B, T] with T > queries >= 1, got "
                         f"{tuple(ids.shape)} and queries={queries}")
    recorder = _Recorder(ir.gm, queries)
    with torch.inference_mode():
        recorder.run(*sequence_inputs(ir, ids))
    if not recorder.layers:
        raise ValueError("attention_rows: the IR has no rw.attention")
    return [recorder.layers[i] for i in sorted(recorder.layers)]


def selections(layer: Recorded, top_k: int, recent: int) -> Tensor:
    """``[B, Hkv, Q, T]`` booleans: what ``layer``, as a selection layer, gives each KV
    head's query group for each recorded query, as ``rw.select_tokens`` chooses it (the
    same ranking, ``top_tokens``): the ``top_k`` keys before the ``recent`` window, then
    the window and the query itself."""
    b, hkv, t, _ = layer.k.shape
    q = layer.q.shape[2]
    pos = torch.arange(t - q, t)[:, None]  # [Q, 1]: each query's own position
    key = torch.arange(t)[None, :]  # [1, T]
    chosen = top_tokens(layer.q, layer.k, key < pos - recent, top_k)  # [B, Hkv, Q, top_k], -1: none
    mask = torch.zeros(b, hkv, q, t + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(chosen < 0, t, chosen), True)  # -1 lands in the spare column
    return mask[..., :t] | ((key >= pos - recent) & (key <= pos))


def kept_mass(layers: Sequence[Recorded], top_k: int, recent: int) -> Tensor:
    """``[L, L]``: entry ``[s, l]`` (``l >= s``; 0 below the diagonal) is the dense
    attention weight layer ``l``'s query heads put on what selection layer ``s`` selects,
    averaged over heads, queries and rows; ``[l, l]`` is a layer's own selection."""
    shapes = {(r.weights.shape[1], r.k.shape[1]) for r in layers}
    if len(shapes) != 1:
        raise ValueError(f"kept_mass: the layers' (query heads, KV heads) differ: "
                         f"{sorted(shapes)}; one selection cannot serve them all")
    ((hq, hkv),) = shapes
    n = len(layers)
    out = torch.zeros(n, n)
    for s in range(n):
        chosen = selections(layers[s], top_k, recent).repeat_interleave(hq // hkv, dim=1)  # [B, Hq, Q, T]
        for l in range(s, n):
            out[s, l] = (layers[l].weights * chosen).sum(-1).mean()
    return out


@dataclass
class Choice:
    selection_layers: List[int]  # positions in the kept-mass matrix
    bytes_read: float  # a decode step's KV bytes, as a fraction of dense attention's
    kept: float  # mean over layers of the attention weight kept (dense layers keep 1)


def best_selection_layers(kept: Tensor, tokens: int, top_k: int, recent: int,
                          budget: float, select_own: bool = False) -> Optional[Choice]:
    """The selection layers that keep the most attention, summed over layers, with a decode
    step reading at most ``budget`` of dense attention's KV bytes at ``tokens`` cached (a
    fraction: 0.25 for 4x fewer); None if nothing fits. Layers before the first selection
    layer read everything; a selection layer reads everything too (TidalDecode's) and keeps
    all its attention, or with ``select_own`` reads every key and its selection's values
    and keeps ``kept[s, s]``; every other layer reads ``top_k + recent + 1`` tokens, with the
    kept mass ``kept[s, l]`` of the latest selection layer ``s`` before it. Of equal
    choices, the one with fewer selection layers.

    A dynamic programme over (latest selection layer, layers before the first, selection
    layers): the bytes depend only on the last two, and grow with each selection, so a
    state over the budget has no extension within it."""
    n = kept.shape[0]
    sparse = min(1.0, (top_k + recent + 1) / tokens)
    chooser = (1.0 + sparse) / 2 if select_own else 1.0  # a selection layer's read

    def read(dense: int, chosen: int) -> float:
        return (dense + chosen * chooser + (n - dense - chosen) * sparse) / n

    def fits(dense: int, chosen: int) -> bool:
        return read(dense, chosen) <= budget + 1e-12

    rows = kept.tolist()
    own = [rows[s][s] if select_own else 1.0 for s in range(n)]
    last = n if select_own else n - 1  # without select_own the last layer's choice is unread
    run = [[0.0] * (n + 1) for _ in range(n)]  # run[s][e]: mass kept by layers s+1 .. e-1 reading s
    for s in range(n):
        for e in range(s + 1, n):
            run[s][e + 1] = run[s][e] + rows[s][e]
    # best[(j, dense, chosen)]: (score, -selections, layers); layers 0 .. j scored
    best: Dict[tuple, tuple] = {}
    for first in range(last):  # layers 0 .. first-1 read everything and keep 1
        if fits(first, 1):
            best[(first, first, 1)] = (first + own[first], -1, [first])
    for j in range(last):
        for (at, dense, chosen), (score, neg, layers) in [(k, v) for k, v in best.items() if k[0] == j]:
            if not fits(dense, chosen + 1):
                continue
            for nxt in range(j + 1, last):
                cand = (score + run[j][nxt] + own[nxt], neg - 1, layers + [nxt])
                if _better(cand, best.get((nxt, dense, chosen + 1))):
                    best[(nxt, dense, chosen + 1)] = cand
    top = None  # (score, -selections, layers, bytes)
    for (j, dense, chosen), (score, neg, layers) in best.items():
        end = (score + run[j][n], neg, layers, read(dense, chosen))
        if _better(end, top):
            top = end
    return Choice(top[2], top[3], top[0] / n) if top is not None else None


def _better(a: tuple, b: Optional[tuple]) -> bool:
    """(score, -selections, ...) ``a`` over ``b``: a higher score, or within rounding of it
    (sums of floats in another order), fewer selection layers, then fewer bytes."""
    if b is None:
        return True
    if abs(a[0] - b[0]) > 1e-9:
        return a[0] > b[0]
    if a[1] != b[1]:
        return a[1] > b[1]
    return len(a) > 3 and a[3] < b[3] - 1e-12
