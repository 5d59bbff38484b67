"""Tree decoding: rounds that verify a tree of drafted tokens, and copied chains, in one
step each (``runtime.decoding.tree.rounds``). The drafter (the record's ``drafter``,
``runtime.decoding.tree.drafters``) says which programs draft the tree:

- ``medusa``: ``heads``, the heads alone on the LM head's input ``h``, run on the accepted
  position only, not on every node of the tree;
- ``hydra``: ``head0`` .. one per head, on ``h`` and the tree's paths, level by level;
- ``eagle``: ``eagle``, the draft layer's weights (``runtime.decoding.tree.eagle_rows``: it keeps a cache
  per row, so it is no lowered graph), with ``tree_prefill`` giving ``h`` at every prompt
  position;
- ``none``: copied chains alone, no draft program.

Every drafter's rounds run ``tree_prefill`` and ``verify``: prefill and decode that also
return ``h``.
"""
from __future__ import annotations

from typing import Iterator, Optional

from torch import Tensor

from rewriter.ir.core import IR

from ..base import Generation, Strategy
from ..checks import check_heads, check_no_ring
from .drafters import DRAFTERS
from .rounds import tree_loop


class TreeStrategy(Strategy):
    def programs(self, ir: IR, lowering) -> dict:
        s = self.record
        check_no_ring(ir, s.KIND)
        if s.drafts:
            check_heads(ir, s)
        # an EAGLE draft catches up over the prompt's every position
        every = "all" if DRAFTERS[s.drafter].every_position else True
        programs = {"tree_prefill": lowering.step(ir, True, hidden=every),
                    "verify": lowering.step(ir, False, hidden=True)}
        programs.update(DRAFTERS[s.drafter].programs(ir, s, lowering))
        return programs

    def tokens(self, g: Generation, learnt: dict) -> Optional[Iterator[Tensor]]:
        s, b = self.record, g.batch.ids.shape[0]
        known = learnt.get((b, s))  # runtime.decoding.tree.adapt: counts of earlier generations
        chains_only = not s.tree_at(b)
        if chains_only and known is not None and known.chain is not None and known.chain.rests():
            return None  # the chain chose no copies at this batch size: plain steps are cheaper
        # rounds of a copied chain alone (no tree at this batch size) need the costs to
        # choose its length, unless chains are all the strategy drafts
        if s.drafts and chains_only and not (s.lookup and s.costs_at(b) is not None):
            return None
        vocab = self.ir.weight("medusa.vocab") if s.draft_vocab is not None else None
        return tree_loop(g.programs, g.cache, g.batch, g.settings, g.generator, g.stats, s,
                         vocab, learnt, **g.replay)
