"""The KV cache as data: a table derived from the IR, and the tensors it allocates.

Every ``rw.attention`` names its cache by its ``layer`` attribute, a stable id: passes that
remove layers (``LayerSkip``) or programs that skip them (a self-speculative draft) leave
the other layers' ids as they were, so every program of a model addresses the same caches.
``cache_table(gm)`` is the single description of those caches (heads, head size, window)
that lowering, the allocator, ``kv_bytes_per_token``, artifacts and dumps read.

Each cache is ``[batch, kv_heads, max_len, head_dim]`` for K and for V, written in place at
each row's positions (``runtime.attention.write_kv``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import fx

from rewriter.errors import RewriterError
from rewriter.ops import ATTRIBUTES, OPS, op_arguments

# The attention op's non-tensor arguments, read from its schema (``rewriter.ops``).
ATTENTION_PARAMS = tuple(ATTRIBUTES["attention"])


@dataclass(frozen=True)
class CacheSpec:
    """One attention op's cache: ``id`` is its ``layer`` attribute."""
    id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    window: Optional[int]
    sinks: Optional[int] = None

    @property
    def ring(self) -> bool:
        """A sink + window cache (``runtime.ring_cache``): bounded, whatever the length."""
        return self.sinks is not None

    def slots(self, max_len: int) -> int:
        """Token slots this cache allocates for sequences of up to ``max_len`` tokens: a
        ring holds its sinks and its window (no more than the sequences need: then it
        never wraps) and one spare slot that padding writes into."""
        return min(self.sinks + self.window, max_len) + 1 if self.ring else max_len

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one slot holds (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bytes_for(self, tokens: int, dtype: torch.dtype) -> int:
        """Bytes this cache holds for one sequence of ``tokens`` tokens."""
        return self.bytes_per_token(dtype) * min(tokens, self.slots(tokens))


def attention_params(node: fx.Node) -> dict:
    """The attention op's non-tensor arguments by name, defaults filled in."""
    bound = op_arguments("attention", tuple(node.args), dict(node.kwargs))
    return {k: bound[k] for k in ATTENTION_PARAMS}


def cache_table(gm: fx.GraphModule) -> dict[int, CacheSpec]:
    """``{id: CacheSpec}`` for every ``rw.attention`` of ``gm``, in graph order."""
    table: dict[int, CacheSpec] = {}
    for n in gm.graph.find_nodes(op="call_function", target=OPS["attention"]):
        p = attention_params(n)
        if p["layer"] in table:
            raise RewriterError(f"{n.name}: two attention ops name cache {p['layer']} (their "
                                f"layer attribute); each layer's attention needs its own")
        table[p["layer"]] = CacheSpec(id=p["layer"], **{k: p[k] for k in ATTENTION_PARAMS
                                                         if k != "layer"})
    return table


def describe(table: dict[int, CacheSpec], dtype: torch.dtype) -> dict:
    """The table as JSON-able data (dumps, ``rewriter info``): ``bytes_per_token`` counts
    the caches that grow with the sequence, ``bounded_bytes`` what the rings hold at most."""
    return {"dtype": str(dtype).removeprefix("torch."),
            "bytes_per_token": sum(s.bytes_per_token(dtype) for s in table.values() if not s.ring),
            "bounded_bytes": sum(s.bytes_per_token(dtype) * (s.sinks + s.window + 1)
                                 for s in table.values() if s.ring),
            "caches": [asdict(s) for s in table.values()]}


def bounded(table: dict[int, CacheSpec]) -> bool:
    """Every cache is a ring: the sequence may outgrow the model's context length."""
    return bool(table) and all(s.ring for s in table.values())


class KVCache:
    """K and V for every cache of ``table``, ``{id: [B, Hkv, slots, D]}`` each: ``max_len``
    slots, or a sink + window cache's ring (``CacheSpec.slots``)."""

    def __init__(self, table: dict[int, CacheSpec], batch: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.table, self.batch, self.max_len = table, batch, max_len
        # zeros, not empty: a padded row's masked slots must hold finite values, because
        # masked attention weights are exactly 0 and 0 * NaN would still be NaN.
        shape = lambda s: (batch, s.num_kv_heads, s.slots(max_len), s.head_dim)  # noqa: E731
        self.k = {i: torch.zeros(shape(s), dtype=dtype, device=device) for i, s in table.items()}
        self.v = {i: torch.zeros(shape(s), dtype=dtype, device=device) for i, s in table.items()}
        self.busy = False  # a generation in progress (e.g. a paused stream) holds it

    def fits(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        k = next(iter(self.k.values()), None)
        return (not self.busy and self.batch == batch and self.max_len >= max_len
                and (k is None or (k.dtype == dtype and k.device == device)))

    @property
    def device(self) -> torch.device:
        k = next(iter(self.k.values()), None)
        return k.device if k is not None else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k.values(), *self.v.values()])

    def bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence occupies, over all caches."""
        return self.nbytes // max(1, self.batch * self.max_len)
