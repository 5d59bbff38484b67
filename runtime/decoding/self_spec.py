"""Self-speculative decoding: the model drafts with some of its layers skipped (or its
weights in 4 bits), then verifies the drafts in one step (``runtime.decoding.speculative``)."""
from __future__ import annotations

from typing import Iterator

from torch import Tensor

from rewriter.errors import RewriterError
from rewriter.ir.core import IR
from rewriter.ir.int4 import quantize_linears
from rewriter.maths.int4 import DEFAULT_GROUP
from rewriter.ir.skip import check_skip_set, skipped

from .base import Generation, Strategy
from .speculative import speculative_loop
from .checks import check_no_ring


class SelfSpeculativeStrategy(Strategy):
    def programs(self, ir: IR, lowering) -> dict:
        """``draft``: the IR with the skip set bypassed (``rewriter.ir.skip``), its linears
        4-bit with ``draft_weights="int4"``, last-position logits."""
        s = self.record
        check_no_ring(ir, s.KIND)
        check_skip_set(ir, s.skip_layers, s.skip_attention, s.skip_mlp,
                       empty_ok=s.draft_weights != "dense")
        draft = skipped(ir, s.skip_layers, s.skip_attention, s.skip_mlp)
        if s.draft_weights == "int4":
            draft = int4_draft(draft)
        return {"draft": lowering.step(draft, True)}

    def tokens(self, g: Generation, learnt: dict) -> Iterator[Tensor]:
        return speculative_loop(g.programs, g.cache, g.batch, g.settings, g.generator, g.stats,
                                self.record, **g.replay)


def int4_draft(draft: IR) -> IR:
    """``draft`` (a copy: ``skipped`` makes one) with its linears' weights in 4 bits, groups
    of ``DEFAULT_GROUP``, as the ``Int4Weights`` pass stores them (``rewriter.ir.int4``);
    the LM head stays dense, as there."""
    try:
        info = quantize_linears(draft, DEFAULT_GROUP, lm_head=False, pass_name="Int4Weights")
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:  # an artifact's odd names
        raise RewriterError(f"the self_speculative draft_weights='int4' draft cannot be made "
                            f"from these weights: {e}") from None
    if info is None:  # e.g. the model's linears are 4-bit already
        raise RewriterError(f"the self_speculative draft_weights='int4' draft has nothing to "
                            f"quantize: no linear has in-features a multiple of {DEFAULT_GROUP}")
    draft.info["int4"] = info
    return draft
