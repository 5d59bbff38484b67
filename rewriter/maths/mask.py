"""``visible``: which keys an attention query sees, the one definition of the attention
mask that the op's reference (``rewriter.ops``), the runtime's steps
(``runtime.attention.Step``) and the sink + window rings (``runtime.ring_cache``) share.

Positions are whatever the caller counts in (cache positions, or a ring's real indices):
only their order and distances matter. Arguments broadcast, so each caller builds the
shape it needs (``[S, K]`` for the reference, ``[B or 1, 1, S, K]`` for a step).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor


def visible(query: Tensor, key: Tensor, window: Optional[int] = None,
            sinks: Optional[int] = None, first_real: Optional[Tensor] = None) -> Tensor:
    """True where the query at position ``query`` may attend to the key at ``key``: causal
    (``key <= query``); with ``window``, only the last ``window`` positions, and the first
    ``sinks`` too (StreamingLLM); with ``first_real`` (each row's first real position, its
    left padding before it), padding keys hidden, but a padding query still sees itself, so
    its softmax row has a finite maximum and no NaN reaches the cache."""
    mask = key <= query
    if window is not None:
        near = query - key < window
        mask = mask & ((near | (key < sinks)) if sinks else near)
    if first_real is not None:
        mask = mask & ((key >= first_real) | (key == query))
    return mask
