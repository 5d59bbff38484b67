"""Learned position embeddings: which lookups are indexed by ``arange(S) + c``.

Hugging Face builds the index of a learned position embedding from the sequence length:
GPT-2 ``arange(past, past + S)`` (``past`` is 0 without a cache), OPT
``cumsum(mask, 1) * mask - 1`` over an all-ones mask, plus its offset 2. The frontend
replaces such an index by ``positions + c``: equal on a whole sequence, and still right
for a step over the KV cache, where ``arange`` would restart at 0. It does so only where
the index provably *is* ``arange(S) + c`` along its last dimension, every row alike; any
other index (BERT's token types, a buffer, a gather) is left as traced and reported.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx

aten = torch.ops.aten

_ADD = {aten.add.Tensor, aten.add.Scalar}
_SUB = {aten.sub.Tensor, aten.sub.Scalar}
_TO = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default}
_INTEGER = {torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8}


def position_offset(node, is_seq_len: Callable[[object], bool]) -> Optional[int]:
    """``c`` when ``node`` holds ``arange(S) + c`` along its last dimension (``[S]``,
    ``[1, S]`` or ``[B, S]``, every row alike), else None. ``is_seq_len(a)`` says whether
    an argument is the sequence length ``S`` of the token ids."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    t, a = node.target, node.args
    if t == aten.arange.default and is_seq_len(a[0]) and _int_dtype(node):
        return 0
    if t == aten.arange.start and _const(a[0]) == 0 and is_seq_len(a[1]) and _int_dtype(node):
        return 0
    if t in _ADD | _SUB and _const(a[1]) is not None and node.kwargs.get("alpha", 1) == 1:
        base = position_offset(a[0], is_seq_len)
        sign = 1 if t in _ADD else -1
        return None if base is None else base + sign * _const(a[1])
    if t == aten.unsqueeze.default and a[1] == 0 and _rank(a[0]) == 1:
        return position_offset(a[0], is_seq_len)
    if t == aten.expand.default:  # broadcasts a [1, S] row to [B, S]
        return position_offset(a[0], is_seq_len)
    if t in _TO and _int_dtype(node):
        return position_offset(a[0], is_seq_len)
    if t == aten.cumsum.default and a[1] in (-1, _rank(a[0]) - 1) and _is_ones(a[0], is_seq_len):
        return 1  # cumsum of ones along S: 1, 2, ..., S
    if t == aten.mul.Tensor:  # OPT's cumsum(mask) * mask, the mask all ones
        for x, y in (a, a[::-1]):
            if _is_ones(y, is_seq_len) or _const(y) == 1:
                return position_offset(x, is_seq_len)
    return None


def _is_ones(node, is_seq_len) -> bool:
    """An all-ones ``[S]`` or ``[A, S]`` tensor (``ones`` / ``new_ones``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target == aten.ones.default:
        size = node.args[0]
    elif node.target == aten.new_ones.default:
        size = node.args[1]
    else:
        return False
    return isinstance(size, (list, tuple)) and 1 <= len(size) <= 2 and is_seq_len(size[-1])


def _const(a) -> Optional[int]:
    return a if isinstance(a, int) and not isinstance(a, bool) else None


def _rank(node) -> Optional[int]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _int_dtype(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in _INTEGER
