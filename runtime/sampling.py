"""Choosing the next token: greedy, or sampling shaped as Hugging Face shapes it.

The order and meaning follow ``transformers`` generation: logits are divided by
``temperature``, then only the ``top_k`` largest are kept, then only the smallest set of
tokens whose probabilities add up to more than ``top_p`` (always at least one). Defaults
are Hugging Face's (``temperature=1.0, top_k=50, top_p=1.0``). Everything stays on the
device: no host synchronisation per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = 50
    top_p: float = 1.0

    def __post_init__(self):
        if not self.do_sample:
            return  # greedy ignores the sampling settings, as Hugging Face does
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None: no limit), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def warp(logits: Tensor, s: Sampling) -> Tensor:
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


def next_token(logits: Tensor, s: Sampling, generator: Optional[torch.Generator]) -> Tensor:
    """The chosen token of every row, ``[B]`` int64, from last-position logits ``[B, V]``."""
    if not s.do_sample:
        return logits.argmax(-1)
    probs = warp(logits, s).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
