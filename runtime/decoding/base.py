"""What a decoding strategy is to the engine (``Strategy``), the one generation its token
loop runs (``Generation``), and how rounds that make several tokens a row give them out as
plain decoding does (``Columns``: the column queue and end-of-sequence handling)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

from rewriter.ir.core import IR

from ..generate import Batch
from ..kv_cache import KVCache
from ..replay import Replays
from ..settings import GenerationSettings


@dataclass
class Generation:
    """One generation: the lowered programs, the cache it holds (``cache.hold()`` from here
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
        self.release = self.cache.hold()  # a stream not yet started holds it too

    @property
    def replay(self) -> dict:
        """The step options as the token loops take them."""
        return dict(static=self.static, cuda_graph=self.cuda_graph, replays=self.replays)

    def leased(self, tokens: Iterator[Tensor]) -> Iterator[Tensor]:
        """``tokens``, handing the cache back when they end or are dropped."""
        try:
            yield from tokens
        finally:
            self.release()


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


def holds_eos(settings: GenerationSettings, tokens: Iterable[int]) -> bool:
    """Whether ``tokens`` (host ints) hold one of the settings' end-of-sequence ids."""
    return not set(settings.eos_token_id).isdisjoint(tokens)


class Columns:
    """The tokens each row made, given out as plain decoding gives them: one ``[B]`` column
    per position, once every row has made it (rows that ran ahead wait here). A row whose
    tokens hold an end of sequence is done: the rest of its output is padding, queued at
    once (else, copying nothing and drafting past its end, it would hold every column of
    the batch to about a token a round), and a column past a row's end of sequence pads
    that row, as plain decoding's do. ``over``: the generation has all its columns."""

    def __init__(self, settings: GenerationSettings, batch: int, device: torch.device,
                 stats: Counter):
        self.s, self.device, self.stats = settings, device, stats
        self.eos = set(settings.eos_token_id)
        self.pending: list[list[int]] = [[] for _ in range(batch)]  # made, not yet given out
        self.produced = [0] * batch  # tokens each row made, its queued padding included
        # rows past an end of sequence, on the host: the tokens are host values here, and a
        # device flag read back every column would wait for the GPU's queue each time
        self.finished = [False] * batch
        self.given = 0

    def add(self, row: int, tokens: list[int]) -> None:
        """Row ``row`` made ``tokens`` (host ints)."""
        self.pending[row] += tokens
        self.produced[row] += len(tokens)
        if holds_eos(self.s, tokens):
            self.pending[row] += [self.s.pad_token_id] * max(0, self.s.max_new_tokens
                                                             - self.produced[row])
            self.produced[row] = max(self.produced[row], self.s.max_new_tokens)

    def done(self) -> list[bool]:
        """Per row: whether it has made every token it needs."""
        return [n >= self.s.max_new_tokens for n in self.produced]

    @property
    def over(self) -> bool:
        return self.given == self.s.max_new_tokens or bool(self.eos and all(self.finished))

    def ready(self) -> Iterator[Tensor]:
        """The whole columns made so far, each row's finished ones as padding, copied to
        the device at once."""
        columns = []
        while all(self.pending) and len(columns) < self.s.max_new_tokens - self.given:
            column = [self.s.pad_token_id if f else t
                      for t, f in zip([p.pop(0) for p in self.pending], self.finished)]
            self.finished = [f or t in self.eos for t, f in zip(column, self.finished)]
            columns.append(column)
            if self.eos and all(self.finished):
                break
        if columns:
            for token in torch.tensor(columns, device=self.device):  # [C, B]
                self.stats["tokens"] += 1
                self.given += 1
                yield token
