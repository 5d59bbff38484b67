"""``PromptLookup``: lossless speculative decoding whose drafts are copied from the text.

    PromptLookup()                 # up to 4 copied tokens a round, as many as pay
    PromptLookup(tokens=8, adapt=False)   # always the whole chain

A model's continuation often repeats its context (code re-uses names and signatures; an
answer quotes its question or a retrieved passage). Each round, every row copies the tokens
that followed the latest earlier occurrence of its text's last 1-3 tokens
(``runtime.decoding.tree.lookup``), and the model verifies them in one step: the output is the
model's own (greedy tokens, or its sampling distribution). No draft model and no heads: it
needs nothing trained and works on any model whose logits come from a linear LM head (the
rounds are the draft heads', which return the head's input too; not with
``Int4Weights(lm_head=True)``).

The graph is left as it is; the pass records the strategy (``rewriter.decoding``). With
``adapt=True`` it measures here what a round verifying 1 .. ``tokens + 1`` tokens costs
against a plain decode step, at 1, 2, 4 and 8 rows: the programs' cost
(``Measurer.verify_cost``) and the round's own work (building and scoring chains,
accepting), timed by the measurer ``rewriter.optimize`` gives (the runtime, on the backend
and device that will run the model) on a made-up prompt that repeats
(``rewriter.measure.round_cost``); ``ir.info["measured_on"]`` says where. The rounds then
verify as many copies as pay for their cost on the text being decoded, by how long a match
found them (a chain after a 3-token match is right far more often than one after a single
token): none where the text never repeats (``lookup.ChainLength``), and then the engine
decodes plainly for a few generations before it tries again.
``MedusaHeads`` and ``HydraHeads`` copy the same chains beside their trees (their
``lookup``).
"""
from __future__ import annotations

from typing import Optional

from rewriter.decoding import MAX_LOOKUP, TreeDecoding, check_record, check_undecided
from rewriter.errors import PassError
from rewriter.ir.core import IR
from rewriter.ir.pass_manager import Measurer, Pass
from rewriter.measure import round_cost
from rewriter.measure.calibrate import ShortContext
from rewriter.drafts.tree import MAX_NODES
from rewriter.passes.draft_graph import lm_head

BATCHES = (1, 2, 4, 8)  # batch sizes whose costs are measured (a larger batch: the largest's)


class PromptLookup(Pass):
    measures = True  # with adapt: the rounds' costs

    def __init__(self, tokens: int = 4, adapt: bool = True):
        if type(tokens) is not int or not 1 <= tokens <= MAX_LOOKUP:
            raise ValueError(f"PromptLookup: tokens must be an int in [1, {MAX_LOOKUP}] (copied "
                             f"tokens a round verifies, at most), got {tokens!r}")
        if not isinstance(adapt, bool):
            raise ValueError(f"PromptLookup: adapt must be True or False, got {adapt!r}")
        self.tokens, self.adapt = tokens, adapt
        self.report: dict | None = None  # the costs measured

    def run(self, ir: IR, measurer: Optional[Measurer] = None) -> IR:
        check_undecided(ir, self)
        try:
            lm_head(ir)
        except PassError:
            raise PassError(f"{self!r}: its rounds (the draft heads' loop) need the logits to come "
                            f"from a plain linear LM head (not Int4Weights(lm_head=True))") from None
        costs = self._costs(ir, self.measurer(ir, measurer)) if self.adapt else ()
        record = TreeDecoding("none", lookup=self.tokens, costs=costs).record()
        why = check_record(record)
        if why:
            raise PassError(f"{self!r}: the decoding record needs {why}")
        ir.info["decoding"] = record
        return ir

    def _costs(self, ir: IR, measurer: Measurer) -> tuple:
        """``((batch, 0.0, (round of 1, 2, .. tokens)), ..)`` in plain steps."""
        most = min(self.tokens + 1, MAX_NODES)
        try:
            programs = {b: measurer.verify_cost(ir, most, runs=5, batch=b)[1:] for b in BATCHES}
            rough = tuple((b, 0.0, tuple(min(max(c, 1e-3), 1e3) for c in programs[b]))
                          for b in BATCHES)
            times = measurer.round_times(ir, TreeDecoding("none", lookup=self.tokens, costs=rough),
                                         BATCHES)
        except ShortContext as e:
            raise PassError(f"{e}: give PromptLookup fewer tokens (tokens={self.tokens} now), or "
                            f"adapt=False (nothing is timed)") from None
        except RuntimeError as e:  # no timed round verified a whole chain on the made-up text
            raise PassError(f"{self!r}: could not time a round of {self.tokens} copied tokens on "
                            f"this model ({e}); give adapt=False (every chain verified whole)") from None
        costs = tuple((b, 0.0, tuple(round(c, 4) for c in round_cost.adjust(0.0, programs[b], times[b])[1]))
                      for b in BATCHES)
        self.report = {"verify_cost": {str(b): [round(c, 3) for c in programs[b]] for b in BATCHES},
                       "round_cost": {str(b): list(c) for b, _, c in costs}}
        return costs
