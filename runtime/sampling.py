"""Choosing the next token: greedy, or sampling shaped as Hugging Face shapes it.

The order and meaning follow ``transformers`` generation: logits are divided by
``temperature``, then only the ``top_k`` largest are kept, then only the smallest set of
tokens whose probabilities add up to more than ``top_p`` (always at least one). Defaults
are Hugging Face's (``temperature=1.0, top_k=50, top_p=1.0``). Everything stays on the
device: no host synchronisation per token. The settings arrive checked
(``GenerationSettings``): nothing here validates again.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rewriter.runtime.settings import GenerationSettings


def warp(logits: Tensor, s: GenerationSettings) -> Tensor:
    """Sampling logits ``[B, V]`` (float32) with excluded tokens at ``-inf``."""
    logits = logits.float()
    if s.temperature != 1.0:
        logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        cumulative = ascending.softmax(-1).cumsum(-1)  # [B, V]
        drop = cumulative <= 1.0 - s.top_p  # the low tail whose mass is <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def greedy(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)``, 2-5x faster on a CPU: ``max`` over the last dimension returns
    the same index (the first largest, NaN counting as largest, on every device), and its
    CPU kernel is faster (2-core Xeon, torch 2.13, SmolLM2's 49,152 logits in bfloat16:
    0.16 ms against 0.04 for one row, 1.25 ms against 0.27 for a 15-node tree's rows)."""
    return logits.max(-1).indices


def next_token(logits: Tensor, s: GenerationSettings,
               generator: Optional[torch.Generator]) -> Tensor:
    """The chosen token of every row, ``[B]`` int64, from last-position logits ``[B, V]``."""
    if not s.do_sample:
        return greedy(logits)
    probs = warp(logits, s).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
