"""What timing a strategy's rounds (``rewriter.measure.round_cost``) needs of the runtime: a
record's programs, lowered without writing the record into the IR, and tree rounds whose
replays a clock times."""
from __future__ import annotations

from collections import Counter
from typing import Callable, Iterator, Optional

from torch import Tensor

from rewriter.decoding import Decoding, TreeDecoding
from rewriter.ir.core import IR

from ..generate import Batch
from ..kv_cache import KVCache
from ..programs import build_programs
from ..settings import GenerationSettings
from .tree.rounds import TreeRounds
from . import strategy_for


def programs_for(ir: IR, record: Decoding, backend: str = "torch") -> dict:
    """The programs ``record``'s strategy runs on ``ir`` (``ir.info`` is not read or written)."""
    return build_programs(ir, backend, {}, strategy_for(ir, record))


def tree_rounds(programs: dict, cache: KVCache, batch: Batch, settings: GenerationSettings,
                stats: Counter, record: TreeDecoding, vocab: Optional[Tensor], learnt: dict,
                static: bool = False, cuda_graph: bool = False,
                clock: Optional[Callable] = None) -> Iterator[Tensor]:
    """Greedy tree rounds (``rounds.tree_loop``), each static step's replay called
    through ``clock(replay, *inputs)`` where given."""
    rounds = TreeRounds(programs, cache, batch, settings, None, stats, record, vocab, learnt,
                        static=static, cuda_graph=cuda_graph)
    rounds.clock = clock
    return rounds.run()
