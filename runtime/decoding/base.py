"""What a decoding strategy is to the engine (``Strategy``), and the one generation its
token loop runs (``Generation``)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from rewriter.ir.core import IR

from ..generate import Batch
from ..kv_cache import KVCache
from ..replay import Replays
from ..settings import GenerationSettings


@dataclass
class Generation:
    """One generation: the lowered programs, the cache it holds (``cache.busy`` from here
    until its tokens end or are dropped: ``leased``), the batch, the settings resolved for
    the model, the random generator, the engine's counters, and how steps run (``static``:
    on fixed buffers, ``cuda_graph``: replayed from CUDA graphs kept in ``replays``;
    ``runtime.replay``)."""
    programs: dict
    cache: KVCache
    batch: Batch
    settings: GenerationSettings
    generator: Optional[torch.Generator]
    stats: Counter
    static: bool = False
    cuda_graph: bool = False
    replays: Optional[Replays] = None

    def __post_init__(self):
        self.cache.busy = True  # a stream not yet started holds it too

    @property
    def replay(self) -> dict:
        """The step options as the token loops take them."""
        return dict(static=self.static, cuda_graph=self.cuda_graph, replays=self.replays)

    def leased(self, tokens: Iterator[Tensor]) -> Iterator[Tensor]:
        """``tokens``, handing the cache back when they end or are dropped."""
        try:
            yield from tokens
        finally:
            self.cache.busy = False


class Strategy:
    """A decoding strategy, made from its record (``rewriter.decoding``) and the IR it
    decodes. ``speculative``: its generations run rounds, which the speed guard
    (``runtime.speed_guard``) may trade for plain steps where those are faster."""
    speculative = True

    def __init__(self, record, ir: IR):
        self.record, self.ir = record, ir

    def cache_slack(self) -> int:
        """Cache positions a generation may need past prompt + new tokens."""
        return self.record.cache_slack()

    def programs(self, ir: IR, lowering) -> dict:
        """The programs it runs beside ``prefill`` and ``decode`` (``lowering``:
        ``runtime.programs.Lowering``), after checking that ``ir`` fits the record (a later
        pass, or an edited artifact, may not): ``RewriterError`` names what does not."""
        return {}

    def tokens(self, g: Generation, learnt: dict) -> Optional[Iterator[Tensor]]:
        """Its token loop: the next token of every row, ``[B]``, each step; None where it
        decodes plainly at this batch size. ``learnt``: what earlier generations learnt,
        by (batch size, record), kept by the engine."""
        raise NotImplementedError
