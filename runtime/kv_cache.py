"""The static KV cache: one preallocated K and V tensor per attention op.

Slots are numbered by the order of the ``rw.attention`` ops in the graph, not by their
``layer`` attribute: after ``LayerSkip`` the layers are ``0, 1, 4, 7`` but the cache
holds four slots. Each slot is ``[batch, kv_heads, max_len, head_dim]`` and is written in
place at the cache positions of every step (gpt-fast's ``k_cache[:, :, pos] = k``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx


@dataclass(frozen=True)
class AttentionSpec:
    """What the runtime needs to know of one attention op."""
    slot: int
    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    window: Optional[int]


ATTENTION_PARAMS = ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "causal", "window")


def attention_specs(gm: fx.GraphModule) -> list[AttentionSpec]:
    """One spec per ``rw.attention`` node, in graph order (= cache slot)."""
    from rewriter.ops import OPS
    specs = []
    for n in gm.graph.find_nodes(op="call_function", target=OPS["attention"]):
        specs.append(AttentionSpec(len(specs), **attention_params(n)))
    return specs


def attention_params(node: fx.Node) -> dict:
    """The op's non-tensor arguments by name, defaults filled in."""
    names = ("q", "k", "v") + ATTENTION_PARAMS
    params = dict(zip(names, node.args))
    params.update(node.kwargs)
    params.setdefault("causal", True)
    params.setdefault("window", None)
    return {k: params[k] for k in ATTENTION_PARAMS}


class KVCache:
    """K and V for every attention slot, ``[B, Hkv, max_len, D]`` each."""

    def __init__(self, specs: list[AttentionSpec], batch: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.specs, self.batch, self.max_len = specs, batch, max_len
        # zeros, not empty: a padded row's masked slots must hold finite values, because
        # masked attention weights are exactly 0 and 0 * NaN would still be NaN.
        shape = lambda s: (batch, s.num_kv_heads, max_len, s.head_dim)  # noqa: E731
        self.k = [torch.zeros(shape(s), dtype=dtype, device=device) for s in specs]
        self.v = [torch.zeros(shape(s), dtype=dtype, device=device) for s in specs]
        self.busy = False  # a generation in progress (e.g. a paused stream) holds it

    def fits(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        k = self.k[0] if self.k else None
        return (not self.busy and self.batch == batch and self.max_len >= max_len
                and (k is None or (k.dtype == dtype and k.device == device)))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """Cache bytes one token of one sequence occupies, over all slots."""
        return self.nbytes // max(1, self.batch * self.max_len)
