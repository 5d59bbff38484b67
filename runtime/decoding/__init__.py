"""Decoding strategies as the engine runs them: one class per record of
``rewriter.decoding``, each with the same protocol (``base.Strategy``): the programs it
needs beside ``prefill`` and ``decode`` (checking the IR fits its record first), the cache
positions it may need past prompt + new tokens, and its token loop.

    strategy = strategy_for(ir)          # the IR's recorded strategy
    programs.update(strategy.programs(ir, lowering))
    tokens = strategy.tokens(generation, learnt)

The engine, the program builder and lowering name no strategy: they look one up here.
"""
from __future__ import annotations

from typing import Optional

from rewriter.decoding import (Decoding, PlainDecoding, SelfSpeculativeDecoding, TreeDecoding,
                               strategy_of)
from rewriter.ir.core import IR

from .base import Generation, Strategy
from .plain import PlainStrategy
from .self_spec import SelfSpeculativeStrategy
from .tree import TreeStrategy

STRATEGIES = {PlainDecoding: PlainStrategy, SelfSpeculativeDecoding: SelfSpeculativeStrategy,
              TreeDecoding: TreeStrategy}

__all__ = ["STRATEGIES", "Generation", "PlainStrategy", "SelfSpeculativeStrategy", "Strategy",
           "TreeStrategy", "strategy_for"]


def strategy_for(ir: IR, record: Optional[Decoding] = None) -> Strategy:
    """The strategy that decodes ``ir``: the one its ``info`` records, or ``record``."""
    record = record if record is not None else strategy_of(ir.info)
    return STRATEGIES[type(record)](record, ir)
