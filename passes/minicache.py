"""``MiniCache``: adjacent layers' KV caches merged into one, from the middle of the model.

    attention(q_l, k_l, v_l, layer=l);  attention(q_m, k_m, v_m, layer=m)
becomes
    attention(q_l, k_l, v_l, layer=l, merge_with=m, merge=[t, gamma, retain])
    attention(q_m, k_m, v_m, layer=m, merge_with=l, merge=[t, gamma, retain])

for the pairs of adjacent attention layers from ``start`` (default: the middle one,
``L // 2``) on: ``(S, S+1), (S+2, S+3), ...``; a last odd layer stays alone. Nothing else
changes in the IR, which still computes exact attention: the runtime keeps each pair as
one merged cache (``runtime.merged_cache``: one SLERP-merged direction per token and KV
head, each layer's magnitudes, the most distinct tokens retained in a side buffer of
at most ``retain`` times a row's tokens), so the loss shows through the runtime
(``Engine.score``, ``generate``). Training-free, and lossy on models whose adjacent layers
differ (``docs/kv_sharing.md``: measure it).

``t`` is SLERP's interpolation (0.5: the middle), ``gamma`` the retention share of the
distance range (0.05: the paper's best); ``gamma=1, retain=1`` keeps every token and
gives the model's tokens. Rings, selections, shared caches (ShareKV) and DuoAttention are
refused by name (``rewriter.ir.merging``), and so are the speculative strategies.
"""
from __future__ import annotations

import math
from typing import Optional

from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.merging import merge
from rewriter.ir.pass_manager import Pass
from rewriter.ir.sharing import attention_by_layer
from rewriter.values import MAX_INT, is_int


class MiniCache(Pass):
    def __init__(self, start: Optional[int] = None, t: float = 0.5, gamma: float = 0.05,
                 retain: float = 0.05):
        if start is not None and (not is_int(start) or not 0 <= start <= MAX_INT):
            raise ValueError(f"MiniCache: start must be a layer (an integer >= 0) or None for "
                             f"the middle one, got {start!r}")
        for name, value in (("t", t), ("gamma", gamma), ("retain", retain)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not 0 <= value <= 1:
                raise ValueError(f"MiniCache: {name} must be a number in [0, 1], got {value!r}")
        self.start = int(start) if start is not None else None
        self.t, self.gamma, self.retain = float(t), float(gamma), float(retain)

    def run(self, ir: IR) -> IR:
        if ir.info.get("decoding") is not None:
            raise PassError(f"{self!r} refuses the speculative strategy "
                            f"({ir.info['decoding']['strategy']}): a rollback cannot take "
                            f"tokens back out of a merged cache")
        layers = sorted(attention_by_layer(ir.graph))
        if not layers:
            raise PassError(f"{self!r}: the IR has no rw.attention op")
        merge(ir, self.pairs(layers), [self.t, self.gamma, self.retain], repr(self))
        return ir

    def pairs(self, layers: list[int]) -> list[tuple[int, int]]:
        """``[(first, second), ...]`` of the attention layers present (ascending ids)."""
        at = len(layers) // 2 if self.start is None else (
            layers.index(self.start) if self.start in layers else None)
        if at is None:
            raise PassError(f"{self!r}: layer {self.start} has no attention (layers "
                            f"{layers[0]}..{layers[-1]})")
        found = [(layers[i], layers[i + 1]) for i in range(at, len(layers) - 1, 2)]
        if not found:
            raise PassError(f"{self!r}: no pair of attention layers from layer {layers[at]} "
                            f"on (layers {layers[0]}..{layers[-1]}): nothing to merge")
        return found
