"""Plain decoding: one token a step (``generate.decode_loop``)."""
from __future__ import annotations

from typing import Iterator

from torch import Tensor

from ..generate import decode_loop
from .base import Generation, Strategy


class PlainStrategy(Strategy):
    speculative = False

    def tokens(self, g: Generation, learnt: dict) -> Iterator[Tensor]:
        return plain_tokens(g)


def plain_tokens(g: Generation) -> Iterator[Tensor]:
    """One token a step, whatever the strategy (the speed guard's fallback too)."""
    return decode_loop(g.programs["prefill"], g.programs["decode"], g.cache, g.batch,
                       g.settings, g.generator, g.stats, **g.replay)
