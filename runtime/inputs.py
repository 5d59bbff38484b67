"""The checks of what a caller hands an ``Engine`` beside the generation settings
(``runtime.settings``): the token ids and their length, explicit positions, a scored
row's prefix, a token count. Each raises a ``ValueError`` naming the argument and what
is wrong with it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, fx

from rewriter.values import is_int

from .kv_cache import unbounded_length


def check_token_ids(ids: Tensor, vocab: Optional[int]) -> None:
    """``ids`` is an integer ``[batch, seq]`` tensor of ids in ``[0, vocab)``; the error
    names the first id outside."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        shown = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {shown}")
    if not ids.numel() or vocab is None:
        return
    outside = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(outside):
        b, s = outside[0].tolist()
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab}): "
                         f"row {b} has {int(ids[b, s])}")


def check_length(ids: Tensor, max_new_tokens: int, max_len: int, gm: fx.GraphModule) -> int:
    """Prompt + new tokens, the cache ``need``: at most ``max_len`` (the model's context
    length) unless ``gm``'s caches let sequences outgrow it (``unbounded_length``)."""
    need = ids.shape[1] + max_new_tokens
    if need > max_len and not unbounded_length(gm):
        raise ValueError(f"prompt ({ids.shape[1]} tokens, padding included) + max_new_tokens "
                         f"({max_new_tokens}) = {need} exceeds the KV cache of "
                         f"{max_len} tokens (the model's context length)")
    return need


def check_positions(input_ids: Tensor, positions, max_len: int, gm: fx.GraphModule) -> None:
    """Explicit positions: integers in ``[0, max_len)`` shaped like ``input_ids``, for a
    graph ``gm`` that reads them (one whose frontend found no position to wire would
    ignore them in silence)."""
    if (not isinstance(positions, Tensor) or positions.shape != input_ids.shape
            or positions.dtype not in (torch.int64, torch.int32)
            or (positions.numel() and int(positions.min()) < 0)):
        shown = (f"{positions.dtype} {list(positions.shape)}" if isinstance(positions, Tensor)
                 else type(positions).__name__)
        raise ValueError(f"positions must be a non-negative integer tensor shaped like "
                         f"input_ids {list(input_ids.shape)}, got {shown}")
    if positions.numel() and int(positions.max()) >= max_len:
        raise ValueError(f"positions must be < {max_len} (the model's context length), "
                         f"got {int(positions.max())}")
    placeholder = next((n for n in gm.graph.find_nodes(op="placeholder")
                        if n.target == "positions"), None)
    if placeholder is None or not placeholder.users:
        raise ValueError("positions were given, but this model reads none (the frontend "
                         "wired no position embedding or rotary table to them)")


def check_prefix(prefix, s: int) -> int:
    """``prefix``, the tokens of an ``s``-token row that are given, not scored: an int in
    ``[1, s)``."""
    if not is_int(prefix) or not 1 <= prefix < s:
        raise ValueError(f"prefix must be an int in [1, {s - 1}] for {s}-token rows, got {prefix!r}")
    return int(prefix)


def token_count(name: str, tokens) -> int:
    """``tokens``, an integer >= 1 (a numpy integer too), as an ``int``."""
    if not is_int(tokens) or tokens < 1:
        raise ValueError(f"{name}: tokens must be an integer >= 1, got {tokens!r}")
    return int(tokens)
